"""The endpoint table: the ready engine pods of each InferenceService, and its served name.

Plain data fed with Kubernetes objects as dicts (watch events, or whole lists after a
relist); watch.py feeds it from the apiserver, tests feed it directly. The proxy reads it
on every request, so reads are dictionary lookups of precomputed tuples.

Just over 300 lines for a stated reason: every index the proxy reads (pods, served names, adapters,
keys) is rebuilt in one place when the services change, so no read sees one index newer than another.
"""
from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple, TypeVar, cast

from pydantic import BaseModel, ValidationError

from kaon_operator import api, kubetime, labels, naming, urls
from kaon_operator.children import resources
from kaon_operator.router import adapter_names

logger = logging.getLogger("kaon.router.endpoints")

# Engine pods of every InferenceService (labels.engine_selector, for any name).
ENGINE_POD_SELECTOR = f"{labels.COMPONENT}={labels.ENGINE},{labels.SERVICE}"


ServiceKey = api.Key  # the router's name for it
MOST_RESOLVED = 4096
MOST_RESOLVED_LENGTH = 256


class Endpoint(NamedTuple):
    """One ready engine pod.

    A tuple: a request looks its pod up in several maps (in flight, back-off, tried), and a tuple's hash and
    equality are the interpreter's own, in C, where a dataclass's are Python methods (a frozen dataclass builds a
    tuple of its fields at every lookup; even a kept hash returned by a Python __hash__ cost a call each time)."""

    namespace: str
    pod: str
    service: str
    url: str  # http://ip:port, no trailing slash


@dataclass(frozen=True, slots=True)
class Service:
    """An InferenceService as the router reads it (`service()`)."""

    key: ServiceKey
    served_name: str
    created: int  # unix seconds; the oldest InferenceService keeps a contested served name
    hold_seconds: float | None
    """How long a request may wait for a first ready pod: an autoscaled service's
    scaleFromZeroTimeoutSeconds, which covers a cold start (None: the router's --queue-timeout)."""
    strategy: str
    """spec.routing.strategy: the name of a routing strategy (strategies.STRATEGIES)."""
    load_bound: float
    """spec.routing.loadBound: with prefix-affinity, how far above the mean load a pod may go."""
    key_digests: tuple[bytes, ...] | None
    """SHA-256 digests of the accepted API keys, from status.auth (the operator publishes them from
    spec.auth's Secret; key_digests.py): None without spec.auth (open), empty while none is
    published for the Secret spec.auth names now (closed to everyone)."""
    max_num_seqs: int
    """spec.engine.maxNumSeqs (unset: a GPU engine's default, api.ENGINE_GPU_MAX_NUM_SEQS): sequences one pod runs
    at once (prefix-affinity keeps a request off a pod with no free slot while another has one)."""
    adapters: tuple[str, ...] = ()
    """spec.adapters' names: each is a `model` that reaches this service (the engine serves it as is)."""
    max_loras: int = 1
    """spec.engine.maxLoras: adapters one pod keeps in its slots (adapter affinity models them)."""
    model_digest: str = ""
    """A digest of spec.model: an InferenceRoute's cache entries end with a change of it (routes/cache_keys.py)."""

    def adapter_of(self, model: object) -> str | None:
        """The adapter a request's `model` names (`<adapter>` or `<namespace>/<adapter>`), if it names one."""
        if not self.adapters or not isinstance(model, str) or model == self.served_name:
            return None
        namespace, slash, rest = model.partition("/")
        name = rest if slash and namespace == self.key.namespace else model
        return name if name in self.adapters else None


def _is_ready(status: dict) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def endpoint(pod: dict) -> Endpoint | None:
    """The pod as a target, or None while it must get no traffic: not Ready, without an IP
    yet, or terminating (its engine is draining; Ready lags behind the deletion)."""
    meta, status = pod["metadata"], pod.get("status") or {}
    ip = status.get("podIP")
    if not ip or meta.get("deletionTimestamp") or not _is_ready(status):
        return None
    # Probes and the Service address the container port by its name, and so does the router.
    url = urls.base_url(ip, urls.named_port(pod, "http", default=resources.HTTP_PORT))
    return Endpoint(meta["namespace"], meta["name"], meta["labels"][labels.SERVICE], url)


def service(isvc: dict) -> Service:
    """The InferenceService's routing facts, read through api.py's models so that their
    defaults are the router's too. Each section is read on its own, and one that does not
    validate (the apiserver refuses those; an object written by hand may hold one) reads as
    its defaults rather than stopping the watch, except spec.auth, which then refuses every
    request: a protected service is never opened by a typo."""
    meta, spec = isvc["metadata"], isvc.get("spec") or {}
    key = ServiceKey(meta["namespace"], meta["name"])
    autoscaling = _section(key, spec, "autoscaling", api.AutoscalingSpec)
    routing = _section(key, spec, "routing", api.RoutingSpec)
    engine = _section(key, spec, "engine", api.EngineSpec)
    return Service(key, api.served_name(spec.get("model"), meta["name"]),
                   int(kubetime.epoch(meta.get("creationTimestamp")) or 0),
                   autoscaling.scale_from_zero_timeout_seconds if autoscaling.enabled else None,
                   routing.strategy, routing.load_bound, _key_digests(key, spec.get("auth"), isvc.get("status") or {}),
                   engine.batch_slots(), adapter_names.valid(key, spec.get("adapters")), engine.max_loras,
                   _model_digest(spec.get("model")))


def _model_digest(model) -> str:
    return hashlib.sha256(json.dumps(model, sort_keys=True, default=str).encode()).hexdigest()[:16]


Section = TypeVar("Section", bound=BaseModel)


def _section(key: ServiceKey, spec: Mapping, name: str, model: type[Section]) -> Section:
    try:
        return model.model_validate(spec.get(name) or {})
    except ValidationError as exc:
        logger.warning("InferenceService %s: spec.%s is not valid, so the router reads its defaults: %s",
                       key, name, exc)
        return model()


def _key_digests(key: ServiceKey, auth, status: Mapping) -> tuple[bytes, ...] | None:
    """The digests published for the Secret spec.auth names now: a digest list left from
    another Secret (spec.auth just edited, not yet published) is not used, nor one that does not
    read as SHA-256 hex."""
    if auth is None:
        return None
    try:
        secret = api.AuthSpec.model_validate(auth).api_key_secret
    except ValidationError as exc:
        logger.warning("InferenceService %s: spec.auth is not valid, so every request is refused: %s", key, exc)
        return ()
    published = status.get("auth") or {}
    if not isinstance(published, Mapping) or published.get("apiKeySecret") != secret:
        return ()
    return tuple(d for d in map(_sha256, published.get("keyDigests") or ()) if d is not None)


def _sha256(hex_digest) -> bytes | None:
    try:
        digest = bytes.fromhex(hex_digest)
    except (TypeError, ValueError):
        return None
    return digest if len(digest) == 32 else None


PodId = tuple[str, str]  # (namespace, pod name)


class EndpointTable:
    """What the router knows of the cluster. `on_change(key)` is called after the endpoints
    or the definition of an InferenceService changed (held requests wake up on it)."""

    def __init__(self, on_change: Callable[[ServiceKey], None] = lambda key: None, default_namespace: str = "default",
                 cluster_wide_names: bool = False):
        self.on_change = on_change
        self.default_namespace = default_namespace
        """Where a bare `model` (no `namespace/`) resolves."""
        self.cluster_wide_names = cluster_wide_names
        """Whether a bare `model` may also resolve in other namespaces (naming.py)."""
        self.reserved: frozenset[str] = frozenset()
        """Bare names the default namespace's InferenceRoutes hold (reserve()): no other namespace's service
        takes them through --cluster-wide-names."""
        self.synced = False
        """True once the first full list of pods and InferenceServices is in."""
        self._pods: dict[PodId, Endpoint] = {}
        self._ready: dict[ServiceKey, tuple[Endpoint, ...]] = {}
        self._services: dict[ServiceKey, Service] = {}
        self._names = naming.index(())
        self._adapters = naming.index(())
        self._key_required_everywhere = False  # key_required_everywhere(), noted at each change of the services
        self._resolved: dict[str, ServiceKey | None] = {}
        """resolve()'s answers since the names last changed (_reindex empties it): every request resolves its `model`,
        and the same few names come again and again. Bounded (a client may send any name): short names only, and at
        most MOST_RESOLVED; default_namespace and cluster_wide_names are fixed once the table is made."""

    # reads -------------------------------------------------------------------

    def resolve(self, model: str) -> ServiceKey | None:
        """The InferenceService a `model` names (naming.py: one reading only; in each reading a served name
        before an adapter's)."""
        try:
            return self._resolved[model]
        except KeyError:
            pass
        found = naming.resolve(model, (self._names, self._adapters), self.default_namespace, self.cluster_wide_names,
                               self.reserved)
        key = found.key if found else None
        if len(model) <= MOST_RESOLVED_LENGTH and len(self._resolved) < MOST_RESOLVED:
            self._resolved[model] = key
        return key

    def reserve(self, names: Iterable[str]) -> None:
        """The default namespace's InferenceRoutes' names now (the route table calls it at each change)."""
        reserved = frozenset(names)
        if reserved != self.reserved:
            self.reserved, self._resolved = reserved, {}

    def engine_model(self, model: str, service: Service) -> str:
        """`model` as the engine knows it: the adapter's name, else the served name."""
        return service.adapter_of(model) or service.served_name

    def api_keys(self, key: ServiceKey) -> tuple[bytes, ...] | None:
        """The digests of the keys a request to this InferenceService must present one of: None when it requires
        none (no spec.auth); empty when its Secret is missing or holds no key (refuse all)."""
        found = self._services.get(key)
        return None if found is None else found.key_digests

    def key_required_everywhere(self) -> bool:
        """Whether there are InferenceServices and every one of them requires a key."""
        return self._key_required_everywhere

    def all_api_keys(self) -> tuple[bytes, ...]:
        """The digests of every key some InferenceService accepts."""
        return tuple(d for s in self._services.values() for d in s.key_digests or ())

    def hold_seconds(self, key: ServiceKey) -> float | None:
        found = self._services.get(key)
        return found.hold_seconds if found else None

    def service(self, key: ServiceKey) -> Service | None:
        return self._services.get(key)

    def endpoints(self, key: ServiceKey) -> tuple[Endpoint, ...]:
        return self._ready.get(key, ())

    def services(self) -> list[Service]:
        """The InferenceServices that answer a name (not shadowed by an older one), by key."""
        return sorted(cast("Iterable[Service]", self._names.qualified.values()), key=lambda s: s.key)

    def addressable(self) -> list[tuple[str, Service]]:
        """Every `model` a client may send here, with the InferenceService it reaches: served names,
        then the adapters (those a served name does not shadow)."""
        both = (self._names, self._adapters)
        served = cast("list[tuple[str, Service]]", naming.addressable(
            self._names, self.default_namespace, self.cluster_wide_names, both, self.reserved))
        adapters = naming.addressable(self._adapters, self.default_namespace, self.cluster_wide_names, both,
                                      self.reserved)
        return served + [(n, self._services[ServiceKey(*a.key)]) for n, a in adapters if self.resolve(n) == a.key]

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
        self._names = naming.index(self._services.values())
        self._resolved = {}
        # Asked of every request (auth.may_send_body): noted here, where the services change, not counted each time.
        self._key_required_everywhere = bool(self._services) and all(s.key_digests is not None
                                                                     for s in self._services.values())
        self._adapters = naming.index(adapter_names.AdapterName(s.key, a, s.created) for s in self._services.values()
                                      for a in s.adapters)
        for key, winner in naming.shadowed(self._services.values(), self.default_namespace).items():
            if key in changed or winner.key in changed:  # once per change, not per event
                logger.warning("InferenceService %s gets no traffic: the default namespace's %s serves its "
                               "`namespace/name` (naming.py)", key, winner.key)
        for key in changed:
            self.on_change(key)
