"""`GET /pressure` on the router's admin port: per InferenceService, the requests this router holds (no
ready replica) and those it has in flight to the ready ones, for the operator's pressure loop
(autoscaling/pressure_sync.py), which reads it every second and wakes standby replicas when capacity is
short (autoscaling/router_pressure.py decides). What Knative's activator tells its autoscaler; here the
operator asks (the same path and port as its /metrics scrape, so no new way in to either), and a read that
fails only leaves the decision to the regular scrape. Only services with requests held or in flight are
listed: an idle router answers an empty list."""
from __future__ import annotations

from collections.abc import Mapping

from kaon_operator.router.endpoints import Endpoint, EndpointTable, ServiceKey


def report(table: EndpointTable, inflight: Mapping[Endpoint, int], held: Mapping[ServiceKey, int]) -> dict:
    """The JSON body: {"services": [{"namespace", "name", "held", "inFlight", "ready"}]}."""
    flying: dict[ServiceKey, int] = {}
    for endpoint, count in inflight.items():
        if count > 0:
            key = ServiceKey(endpoint.namespace, endpoint.service)
            flying[key] = flying.get(key, 0) + count
    keys = sorted(set(flying) | {key for key, count in held.items() if count > 0})
    return {"services": [{"namespace": key[0], "name": key[1], "held": held.get(key, 0),
                          "inFlight": flying.get(key, 0), "ready": len(table.endpoints(key))} for key in keys]}
