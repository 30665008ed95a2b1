"""The router: one OpenAI-compatible gateway in front of every InferenceService.

A request's `model` names an InferenceService (its served name); the router sends it to one
of that service's ready engine pods, chosen by the service's routing strategy.

    endpoints.py  pure: pods and InferenceServices -> the endpoint table
    strategies/   pure decisions by spec.routing.strategy: least-connections, prefix-affinity
    backoff.py    pure: retry candidates, outlier ejection
    request.py    pure: `model`, the body the engine gets, the headers a pod gets (no client credentials)
    json_cost.py  pure: what parsing a body costs (depth, counts, bytes), read off its bytes first
    admission.py  pure: the byte budget (bodies and their parse cost; one client's share of it)
    sse.py        pure: an SSE stream cut into whole events
    pump.py       copies a response body as it arrives, with the idle timeout
    relay.py      passes an engine's response on (whole, or streamed; a broken one ended cleanly)
    hold.py       requests held while a service has no ready pod (the scale-from-zero signal)
    errors.py     OpenAI-shaped error replies
    metrics.py    Prometheus metrics
    config.py     RouterConfig: the flags' values
    proxy.py      the HTTP edge (aiohttp): resolves, holds, picks, forwards, retries
    watch.py      the Kubernetes edge: list + watch that keeps the table current
    main.py       `kaon-router` (python -m kaon_operator.router)

Like the rest of kaon_operator, it never imports torch or kaon_runtime.
"""
