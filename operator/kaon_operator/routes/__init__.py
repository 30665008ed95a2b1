"""InferenceRoute (issue 52): one `model` name in front of several InferenceServices of a namespace,
each request sent to the cheapest tier that can answer it, repeated questions answered from a cache.

Pure modules (api, classifier, cache_keys, answers, memory_store, monitor, figures, table: the routes
the watch saw) and the CRD's generator (crd). The router's side lives in the router package
(router/route_gateway.py: the one object the proxy calls; router/valkey_store.py: the shared cache).
"""
