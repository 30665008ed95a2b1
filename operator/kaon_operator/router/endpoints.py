"""The endpoint table: the ready engine pods of each InferenceService, and its served name.

Plain data fed with Kubernetes objects as dicts (watch events, or whole lists after a
relist); watch.py feeds it from the apiserver, tests feed it directly. The proxy reads it
on every request, so reads are dictionary lookups of precomputed tuples.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import NamedTuple

from kaon_operator import resources

SERVICE_LABEL = "kaon.dev/inferenceservice"
COMPONENT_LABEL = "app.kubernetes.io/component"
# Engine pods of every InferenceService (resources.selector_labels, minus the name).
ENGINE_POD_SELECTOR = f"{COMPONENT_LABEL}=engine,{SERVICE_LABEL}"


class ServiceKey(NamedTuple):
    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One ready engine pod."""

    namespace: str
    pod: str
    service: str
    url: str  # http://ip:port, no trailing slash


@dataclass(frozen=True, slots=True)
class Service:
    key: ServiceKey
    served_name: str
    created: int  # unix seconds; the oldest InferenceService keeps a contested served name
    hold_seconds: float | None = None
    """How long a request may wait for a first ready pod: an autoscaled service's
    scaleFromZeroTimeoutSeconds, which covers a cold start (None: the router's --queue-timeout)."""
    strategy: str = "least-connections"
    """spec.routing.strategy: least-connections or prefix-affinity."""
    load_bound: float = 1.25
    """spec.routing.loadBound: with prefix-affinity, how far above the mean load a pod may go."""


def _is_ready(status: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def _http_port(pod: dict) -> int:
    # Probes and the Service address the container port by its name, and so does the router.
    for container in (pod.get("spec") or {}).get("containers") or ():
        for port in container.get("ports") or ():
            if port.get("name") == "http":
                return port["containerPort"]
    return resources.HTTP_PORT


def endpoint(pod: dict) -> Endpoint | None:
    """The pod as a target, or None while it must get no traffic: not Ready, without an IP
    yet, or terminating (its engine is draining; Ready lags behind the deletion)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp") or not _is_ready(status):
        return None
    host = f"[{ip}]" if ":" in ip else ip
    return Endpoint(meta["namespace"], meta["name"], meta["labels"][SERVICE_LABEL], f"http://{host}:{_http_port(pod)}")


def _epoch(timestamp: str | None) -> int:
    return int(datetime.fromisoformat(timestamp).timestamp()) if timestamp else 0


def service(isvc: dict) -> Service:
    meta = isvc["metadata"]
    spec = isvc.get("spec") or {}
    model, autoscaling = spec.get("model") or {}, spec.get("autoscaling") or {}
    hold = autoscaling.get("scaleFromZeroTimeoutSeconds") if autoscaling.get("enabled") else None
    routing = spec.get("routing") or {}
    return Service(ServiceKey(meta["namespace"], meta["name"]), model.get("servedName") or meta["name"],
                   _epoch(meta.get("creationTimestamp")), hold, routing.get("strategy") or "least-connections",
                   float(routing.get("loadBound") or 1.25))


PodId = tuple[str, str]  # (namespace, pod name)


class EndpointTable:
    """What the router knows of the cluster. `on_change(key)` is called after the endpoints
    or the definition of an InferenceService changed (held requests wake up on it)."""

    def __init__(self, on_change: Callable[[ServiceKey], None] = lambda key: None):
        self.on_change = on_change
        self.synced = False
        """True once the first full list of pods and InferenceServices is in."""
        self._pods: dict[PodId, Endpoint] = {}
        self._ready: dict[ServiceKey, tuple[Endpoint, ...]] = {}
        self._services: dict[ServiceKey, Service] = {}
        self._by_name: dict[str, Service] = {}

    # reads -------------------------------------------------------------------

    def resolve(self, model: str) -> ServiceKey | None:
        found = self._by_name.get(model)
        return found.key if found else None

    def hold_seconds(self, key: ServiceKey) -> float | None:
        found = self._services.get(key)
        return found.hold_seconds if found else None

    def service(self, key: ServiceKey) -> Service | None:
        return self._services.get(key)

    def endpoints(self, key: ServiceKey) -> tuple[Endpoint, ...]:
        return self._ready.get(key, ())

    def services(self) -> list[Service]:
        """The InferenceServices clients can reach, by served name."""
        return [self._by_name[name] for name in sorted(self._by_name)]

    # pods --------------------------------------------------------------------

    def apply_pod(self, event: str, pod: dict) -> None:
        """A watch event: ADDED, MODIFIED or DELETED."""
        meta = pod["metadata"]
        self._refresh(self._set_pod((meta["namespace"], meta["name"]), None if event == "DELETED" else endpoint(pod)))

    def replace_pods(self, namespace: str | None, pods: Iterable[dict]) -> None:
        """A full list of one namespace (None: all): pods missing from it are gone."""
        fresh = {(p["metadata"]["namespace"], p["metadata"]["name"]): endpoint(p) for p in pods}
        gone = [pid for pid in self._pods if pid not in fresh and namespace in (None, pid[0])]
        touched: set[ServiceKey] = set()
        for pid in gone:
            touched |= self._set_pod(pid, None)
        for pid, target in fresh.items():
            touched |= self._set_pod(pid, target)
        self._refresh(touched)

    def _set_pod(self, pid: PodId, target: Endpoint | None) -> set[ServiceKey]:
        old = self._pods.get(pid)
        if old == target:
            return set()
        if target is None:
            del self._pods[pid]
        else:
            self._pods[pid] = target
        # A relabelled pod moves between services: both change.
        return {ServiceKey(e.namespace, e.service) for e in (old, target) if e is not None}

    def _refresh(self, keys: set[ServiceKey]) -> None:
        if not keys:
            return
        members: dict[ServiceKey, list[Endpoint]] = {key: [] for key in keys}
        for e in self._pods.values():
            key = ServiceKey(e.namespace, e.service)
            if key in members:
                members[key].append(e)
        for key, found in members.items():
            if found:
                self._ready[key] = tuple(sorted(found, key=lambda e: e.pod))
            else:
                self._ready.pop(key, None)
        for key in keys:
            self.on_change(key)

    # InferenceServices -------------------------------------------------------

    def apply_service(self, event: str, isvc: dict) -> None:
        found = service(isvc)
        if event == "DELETED":
            self._services.pop(found.key, None)
        elif self._services.get(found.key) == found:
            return
        else:
            self._services[found.key] = found
        self._reindex({found.key})

    def replace_services(self, namespace: str | None, items: Iterable[dict]) -> None:
        fresh = {s.key: s for s in map(service, items)}
        stale = {k for k in self._services if namespace in (None, k.namespace)}
        changed = {k for k in stale | fresh.keys() if self._services.get(k) != fresh.get(k)}
        for key in stale - fresh.keys():
            del self._services[key]
        self._services.update(fresh)
        self._reindex(changed)

    def _reindex(self, changed: set[ServiceKey]) -> None:
        if not changed:
            return
        by_name: dict[str, Service] = {}
        for s in sorted(self._services.values(), key=lambda s: (s.created, s.key)):
            by_name.setdefault(s.served_name, s)
        self._by_name = by_name
        for key in changed:
            self.on_change(key)
