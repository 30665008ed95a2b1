"""The router: one OpenAI-compatible gateway in front of every InferenceService.

A request's `model` names an InferenceService (its served name); the router sends it to
that service's ready engine pod with the fewest requests in flight.

    endpoints.py  pure: pods and InferenceServices -> the endpoint table
    balance.py    pure: least-connections pick, retry candidates, back-off
    hold.py       requests held while a service has no ready pod (the scale-from-zero signal)
    errors.py     OpenAI-shaped error replies
    metrics.py    Prometheus metrics
    proxy.py      the HTTP edge (aiohttp): forwards, streams, retries, holds
    watch.py      the Kubernetes edge: list + watch that keeps the table current
    main.py       `kaon-router` (python -m kaon_operator.router)

Like the rest of kaon_operator, it never imports torch or kaon_runtime.
"""
