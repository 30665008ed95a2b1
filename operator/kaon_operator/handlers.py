"""kopf handlers: thin glue between watch events, the pure modules and the API.

- An InferenceService created, changed or found at start-up: render its children (Deployment,
  Service, PDB, and a NetworkPolicy unless switched off) and server-side apply them at once
  (idempotent), then recompute its status.
- A child deleted or edited by someone else: apply again, with an Event saying so.
- A pod or the Deployment changed: queue the InferenceService for a status update (StatusQueue:
  one per burst of events); the update recomputes the conditions and replica counts and posts
  an Event for every condition that flipped (Ready, Degraded with its reason).
- Pods and children are listed and watched with a label selector (server-side), so the
  operator never receives the cluster's other pods.
- Autoscaling: one loop for all InferenceServices (autoscale_loop.py) scrapes the pods,
  asks the policy (autoscaler.py) and patches spec.replicas, with the decision in the
  status and an Event; no per-object timer, so no finalizer.

Reads come from kopf indexes (in-memory watch caches), so a status update costs one
PATCH and no GETs. Handlers are sync (kopf runs them in a thread pool, so status
updates of one InferenceService are serialised by a lock), except the autoscale loop's.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone

import kopf
import pydantic
from kubernetes.client.rest import ApiException
from prometheus_client import Histogram

from kaon_operator import api, autoscale_loop, changes, resources, status
from kaon_operator.kube import Kube, NamespaceTerminating

ISVC = (api.GROUP, api.VERSION, api.PLURAL)
INSTANCE_LABEL = "kaon.dev/inferenceservice"
ENGINE_CHILD = {INSTANCE_LABEL: kopf.PRESENT, "app.kubernetes.io/component": "engine"}
APPLY_RETRY_SECONDS = 10
APPLY_THREADS = 32  # as many as the API client's connection pool (Kube.from_environment)
NETWORK_POLICIES = ("networking.k8s.io", "v1", "networkpolicies")
CHILD_KINDS = (("apps", "v1", "deployments"), ("", "v1", "services"), ("policy", "v1", "poddisruptionbudgets"),
               NETWORK_POLICIES)
# The same filter, server-side: kopf lists and watches pods and the child kinds with this labelSelector,
# so the apiserver sends the operator kaon's engine objects only, not every pod of the cluster
# (the handlers' labels= filters alone are applied by kopf after it has received everything).
ENGINE_CHILD_SELECTOR = f"{INSTANCE_LABEL},app.kubernetes.io/component=engine"
WATCHED_BY_LABEL = (("", "v1", "pods"), *CHILD_KINDS)
# How long kopf waits to see its own annotation patch come back on the watch before it handles the
# InferenceService's next event anyway. kopf's default (5 s) is exceeded under load (500 objects on a
# busy control plane): the event of the operator's own status patch, which carries no
# last-handled-configuration yet, was then taken for a new object and reconciled a second time.
CONSISTENCY_SECONDS = 60

network_policy: resources.NetworkPolicyConfig | None = None
"""Render a NetworkPolicy per InferenceService (main.py sets it from the command line before kopf runs)."""

RECONCILE_SECONDS = Histogram("kaon_operator_reconcile_seconds", "Time to apply one InferenceService's children",
                              buckets=(.005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10))
STATUS_SECONDS = Histogram("kaon_operator_status_update_seconds", "Time to recompute and write one status",
                           buckets=(.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5))


class State:
    """What the handlers share: the API client, per-object locks, the last status written."""

    def __init__(self, kube: Kube):
        self.kube = kube
        self.appliers = ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="apply")
        self.locks: defaultdict[tuple[str, str], threading.Lock] = defaultdict(threading.Lock)
        self.written: dict[tuple[str, str], dict] = {}
        self.apply_failures: dict[tuple[str, str], str] = {}  # until an apply succeeds again
        self.applied: dict[tuple[str, str], tuple[str, int]] = {}  # (uid, generation) whose children are applied
        self.metrics_conditions: dict[tuple[str, str], dict] = {}  # MetricsAvailable, kept by the autoscaler
        self.pdbs: dict[tuple[str, str], status.PdbSummary] = {}  # each PodDisruptionBudget's status (DisruptionAllowed)
        self.served_names: kopf.Index | None = None  # namespace -> status.ServedName of each InferenceService
        self.name_peers: dict[str, tuple] = {}  # the served names last judged per namespace


def reporting_instance() -> str:
    """Which operator replica posted an Event: the pod name (hostname) and the process."""
    return f"{socket.gethostname()}-{os.getpid()}"


def _state(memo: kopf.Memo) -> State:
    return memo["state"]


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_) -> None:
    # Progress lives in annotations: the CRD's status schema has no room for kopf's own fields.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=api.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=api.GROUP, key="last-handled-configuration")
    settings.persistence.consistency_timeout = CONSISTENCY_SECONDS
    for kind in WATCHED_BY_LABEL:
        settings.watching.label_selectors[kind] = ENGINE_CHILD_SELECTOR
    settings.posting.reporting_component = "kaon-operator"
    settings.posting.reporting_instance = reporting_instance()
    settings.execution.max_workers = 16
    memo.setdefault("state", State(Kube.from_environment()))


# Indexes: kopf keeps them current from its watches before any handler runs. ------------------------------------


@kopf.index(*ISVC)
def inference_services(namespace: str, name: str, body: kopf.Body, **_) -> dict:
    return {(namespace, name): body}


@kopf.index(*ISVC)
def served_names(namespace: str, body: kopf.Body, **_) -> dict:
    """Namespace -> who serves which name there: the NameConflict condition."""
    return {namespace: status.served_name(body)}


@kopf.on.startup()
def keep_served_names(memo: kopf.Memo, served_names: kopf.Index, **_) -> None:
    # The index object stays current (kopf updates it in place): every status sync reads it.
    memo["state"].served_names = served_names


@kopf.on.event(*ISVC)
def served_names_changed(namespace: str, memo: kopf.Memo, served_names: kopf.Index, inference_services: kopf.Index,
                         engine_pods: kopf.Index, engine_deployments: kopf.Index, **_) -> None:
    """An InferenceService came, went or changed its served name: the others of its namespace
    whose NameConflict changes get their status written again (an older one going away frees
    the name; a servedName edit can take one)."""
    state = _state(memo)
    peers = tuple(sorted(served_names.get(namespace, ())))
    if state.name_peers.get(namespace) == peers:
        return  # a status patch or another change that moves no name
    state.name_peers[namespace] = peers
    expected = status.name_conflicts(list(peers))
    for peer in peers:
        written = next((c for c in (state.written.get(peer.key) or {}).get("conditions") or []
                        if c.get("type") == status.NAME_CONFLICT), None)
        want = expected.get(peer.key)
        if (written or {}).get("message") != (want or {}).get("message"):
            _resync(memo, peer.key, inference_services, engine_pods, engine_deployments)


@kopf.index("pods", labels=ENGINE_CHILD)
def engine_pods(namespace: str, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    return {(namespace, labels[INSTANCE_LABEL]): status.summarize_pod(body)}


@kopf.index("apps", "v1", "deployments", labels=ENGINE_CHILD)
def engine_deployments(namespace: str, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    return {(namespace, labels[INSTANCE_LABEL]): status.summarize_deployment(body)}


def _one(index: kopf.Index, key):
    return next(iter(index.get(key, ())), None)


# The InferenceService itself ----------------------------------------------------------------------------------------


def _post(body, events: list[status.EventSpec], kube: Kube | None = None) -> None:
    for event in events:
        try:
            kopf.event(body, type=event.type, reason=event.reason, message=event.message)
        except LookupError:  # outside kopf's per-object tasks (the autoscale loop): no queue to post through
            if kube is not None:
                kube.post_event(body, event.type, event.reason, event.message, reporting_instance())


def _apply_children(state: State, body, spec: api.InferenceServiceSpec) -> list[dict]:
    meta = body["metadata"]
    owner = resources.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    with RECONCILE_SECONDS.time():  # the children at once: one round trip's latency, not four
        applying = [state.appliers.submit(state.kube.apply, m) for m in resources.render(owner, spec, network_policy)]
        return [future.result() for future in applying]


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body)["message"]
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def _parse(spec) -> api.InferenceServiceSpec | str:
    try:
        return api.InferenceServiceSpec.model_validate(dict(spec))
    except pydantic.ValidationError as exc:
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())


@kopf.on.resume(*ISVC)
@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC, field="spec")
def reconcile(body: kopf.Body, namespace: str, name: str, reason: str, old, memo: kopf.Memo,
              engine_pods: kopf.Index, engine_deployments: kopf.Index, **_) -> None:
    state, key = _state(memo), (namespace, name)
    spec = _parse(body["spec"])
    if isinstance(spec, str):
        with state.locks[key]:
            _write_status(state, body, key, status.invalid_spec_conditions(spec), [], None, applied=False)
        return  # nothing to retry: the spec must change first, and that is another event
    version = (body["metadata"]["uid"], body["metadata"].get("generation"))
    if reason != "resume" and state.applied.get(key) == version and key not in state.apply_failures:
        # This generation's children are applied already: kopf handed over an event older than its own
        # last-handled-configuration annotation (see CONSISTENCY_SECONDS). Nothing to apply, no Event.
        _sync_status(state, body, key, spec, engine_pods, engine_deployments, applied=True)
        return
    try:
        children = _apply_children(state, body, spec)
    except NamespaceTerminating:
        return  # the InferenceService goes with its namespace
    except ApiException as exc:
        # Say why in the status and an Event, then let kopf retry: quotas, admission webhooks
        # or a full Service IP range are fixed outside the spec.
        state.apply_failures[key] = f"applying the children failed: {_api_message(exc)}"
        _sync_status(state, body, key, spec, engine_pods, engine_deployments, applied=False)
        raise kopf.TemporaryError(state.apply_failures[key], delay=APPLY_RETRY_SECONDS) from None
    state.apply_failures.pop(key, None)
    state.applied[key] = version
    if reason == "create":
        _post(body, [status.EventSpec("Normal", "Created", "created " + ", ".join(
            f"{c['kind']} {c['metadata']['name']}" for c in children))])
    elif reason == "update":
        previous = _parse(old) if old else None
        if isinstance(previous, api.InferenceServiceSpec):
            decision = (body.get("status") or {}).get("lastScaleDecision") or {}
            _post(body, changes.describe_spec_change(previous, spec, autoscaled=decision.get("to") == spec.replicas))
    _sync_status(state, body, key, spec, engine_pods, engine_deployments, applied=True)


@kopf.on.delete(*ISVC, optional=True)
def deleted(namespace: str, name: str, memo: kopf.Memo, **_) -> None:
    # No finalizer for this handler (optional=True), nor for autoscaling (one loop, no timers):
    # the garbage collector removes the children through their owner references even while
    # the operator is down.
    state = _state(memo)
    for table in (state.written, state.locks, state.metrics_conditions, state.apply_failures, state.applied):
        table.pop((namespace, name), None)


# Status -------------------------------------------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _write_status(state: State, body, key, conditions: list[dict], pods: list[status.PodSummary],
                  spec: api.InferenceServiceSpec | None, *, applied: bool) -> None:
    meta = body["metadata"]
    generation = meta.get("generation", 0)
    last = state.written.get(key) or dict(body.get("status") or {})
    old_conditions = last.get("conditions") or []
    new = {"conditions": status.stamp(conditions, old_conditions, _now(), generation),
           **status.replica_counts(pods), "selector": resources.selector(meta["name"])}
    new["observedGeneration"] = generation if applied else last.get("observedGeneration")
    if spec is not None:
        new["url"] = resources.service_url(resources.Owner(meta["name"], meta["namespace"], meta["uid"]))
    if {k: v for k, v in last.items() if k in new} == new:
        return
    state.kube.patch_status(meta["namespace"], meta["name"], new)
    state.written[key] = new
    _post(body, status.transition_events(new["conditions"], old_conditions), state.kube)


def _sync_status(state: State, body, key, spec: api.InferenceServiceSpec, engine_pods: kopf.Index,
                 engine_deployments: kopf.Index, *, applied: bool | None = None) -> None:
    start = time.perf_counter()
    with state.locks[key]:
        if applied is None:  # not reconciling now: was the current generation applied before?
            last = state.written.get(key) or body.get("status") or {}
            applied = last.get("observedGeneration") == body["metadata"].get("generation")
        deployment = _one(engine_deployments, key)
        pods = list(engine_pods.get(key, ()))
        failure = state.apply_failures.get(key)
        conditions = status.apply_failed_conditions(failure) if failure else status.conditions(
            deployment=deployment, pods=pods, desired=spec.replicas,
            gpus_per_pod=spec.engine.tensor_parallel_size, generation_applied=applied, now=_now())
        if spec.autoscaling.enabled and key in state.metrics_conditions:
            conditions.append(state.metrics_conditions[key])
        disruption = status.disruption_condition(state.pdbs.get(key), pods, _now())
        conditions += [disruption] if disruption else []
        if state.served_names is not None:  # an older one answering this one's served name
            conflict = status.name_conflicts(list(state.served_names.get(key[0], ()))).get(key)
            conditions += [conflict] if conflict else []
        _write_status(state, body, key, conditions, pods, spec, applied=applied)
    STATUS_SECONDS.observe(time.perf_counter() - start)


def _resync(memo: kopf.Memo, key, inference_services: kopf.Index, engine_pods: kopf.Index,
            engine_deployments: kopf.Index) -> None:
    body = _one(inference_services, key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    spec = _parse(body["spec"])
    if isinstance(spec, api.InferenceServiceSpec):
        _sync_status(_state(memo), body, key, spec, engine_pods, engine_deployments)


STARTUP_CHECK_SECONDS = 5.0


@kopf.on.startup()
async def start_startup_watch(memo: kopf.Memo, logger, **kwargs) -> None:
    """A pod that stays not ready past its probes' budget changes nothing the watches see: judge
    the services whose pods ran out of it again (StartupTimeout), every few seconds, from the caches."""
    indexes = kwargs["inference_services"], kwargs["engine_pods"], kwargs["engine_deployments"]

    async def watch() -> None:
        while True:
            await asyncio.sleep(STARTUP_CHECK_SECONDS)
            now = _now()
            for key, pods in list(indexes[1].items()):
                deadline = status.next_startup_deadline(list(pods))
                if deadline is None or deadline > now:
                    continue
                try:
                    await asyncio.to_thread(_resync, memo, key, *indexes)
                except Exception as exc:  # noqa: BLE001 - the next round tries again
                    logger.warning(f"judging {key[0]}/{key[1]}'s startup failed: {exc}")

    _run_in_background(memo, watch())


def _run_in_background(memo: kopf.Memo, work) -> None:
    """A task of the operator's own (not per object, so no finalizer), cancelled at cleanup."""
    memo.setdefault("background", []).append(asyncio.get_running_loop().create_task(work))


@kopf.on.cleanup()
async def stop_background(memo: kopf.Memo, **_) -> None:
    tasks = memo.get("background", [])
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


STATUS_WORKERS = 8


class StatusQueue:
    """InferenceServices whose status must be recomputed after a pod or Deployment event, and the
    workers that do it. A key waits in the queue once however many events name it meanwhile, and is
    computed from the indexes as they are when a worker takes it, so a burst of pod events (a rollout,
    500 objects at once) costs one status write instead of one per event, and kopf's handler threads
    stay free for reconciles. An idle queue adds no delay."""

    def __init__(self, resync, workers: int = STATUS_WORKERS):
        self.resync, self.workers = resync, workers
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued: set = set()

    def mark(self, key) -> None:
        if key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)

    async def run(self) -> None:
        await asyncio.gather(*(self._work() for _ in range(self.workers)))

    async def _work(self) -> None:
        while True:
            key = await self.queue.get()
            self.queued.discard(key)  # an event from now on queues it again
            try:
                await asyncio.to_thread(self.resync, key)
            except Exception:  # noqa: BLE001 - the next event for it tries again
                logging.getLogger("kaon.status").exception(f"updating {key[0]}/{key[1]}'s status failed")


@kopf.on.startup()
async def start_status_queue(memo: kopf.Memo, **kwargs) -> None:
    indexes = kwargs["inference_services"], kwargs["engine_pods"], kwargs["engine_deployments"]
    memo["status_queue"] = queue = StatusQueue(lambda key: _resync(memo, key, *indexes))
    _run_in_background(memo, queue.run())


@kopf.on.event("pods", labels=ENGINE_CHILD)
@kopf.on.event("apps", "v1", "deployments", labels=ENGINE_CHILD)
async def child_status_changed(namespace: str, labels: kopf.Labels, memo: kopf.Memo, **_) -> None:
    memo["status_queue"].mark((namespace, labels[INSTANCE_LABEL]))


@kopf.on.event("policy", "v1", "poddisruptionbudgets", labels=ENGINE_CHILD, id="pdb-status")
async def pdb_status_changed(event: dict, body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo,
                             **_) -> None:
    """The PDB's status says whether evictions (node drains) are refused: DisruptionAllowed."""
    key, state = (namespace, labels[INSTANCE_LABEL]), _state(memo)
    summary = None if event.get("type") == "DELETED" else status.summarize_pdb(body)
    if state.pdbs.get(key) != summary:
        if summary is None:
            state.pdbs.pop(key, None)
        else:
            state.pdbs[key] = summary
        memo["status_queue"].mark(key)


# Drift of the children ------------------------------------------------------------------------------------------------


def _repair(memo: kopf.Memo, namespace: str, owner_name: str, child: kopf.Body, why: str) -> None:
    state = _state(memo)
    body = state.kube.get_inference_service(namespace, owner_name)  # authoritative: is the owner going away?
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    if not any(ref.get("uid") == body["metadata"]["uid"] for ref in child["metadata"].get("ownerReferences", [])):
        return  # labelled like ours but not owned by this InferenceService: not ours to touch
    spec = _parse(body["spec"])
    if isinstance(spec, str):
        return
    before = child["metadata"].get("resourceVersion")
    try:
        applied = _apply_children(state, body, spec)
    except NamespaceTerminating:
        return
    after = next((c["metadata"]["resourceVersion"] for c in applied
                  if c["kind"] == child["kind"] and c["metadata"]["name"] == child["metadata"]["name"]), before)
    if after != before:
        _post(body, [status.EventSpec("Warning", "Repaired", f"{child['kind']} {child['metadata']['name']} {why}")])


def _owned_by_an_inference_service(child: kopf.Body) -> bool:
    return any(ref.get("apiVersion", "").startswith(f"{api.GROUP}/") and ref.get("kind") == api.KIND
               and ref.get("controller") for ref in child["metadata"].get("ownerReferences", []))


def _on_child_event(event: dict, body: kopf.Body, namespace: str, labels: kopf.Labels, memo: kopf.Memo) -> None:
    owner_name = labels[INSTANCE_LABEL]
    if body.get("kind") == "NetworkPolicy" and network_policy is None:
        # Switched off (--no-network-policy): the policies made while it was on go, so that the switch
        # means what it says; kopf lists them all at start-up, so this runs once for each.
        if event.get("type") != "DELETED" and _owned_by_an_inference_service(body):
            _state(memo).kube.delete({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                                      "metadata": {"name": body["metadata"]["name"], "namespace": namespace,
                                                   "uid": body["metadata"].get("uid")}})
        return
    if event.get("type") == "DELETED":
        _repair(memo, namespace, owner_name, body, "was deleted; recreated it")
        return
    editors = changes.foreign_spec_managers(body["metadata"].get("managedFields"))
    if editors and not body["metadata"].get("deletionTimestamp"):
        _repair(memo, namespace, owner_name, body, f"was edited by {', '.join(editors)}; put it back")


def _register_drift_handlers() -> None:
    for group, version, plural in CHILD_KINDS:
        kopf.on.event(group, version, plural, labels=ENGINE_CHILD, id=f"drift-{plural}")(
            lambda event, body, namespace, labels, memo, **_: _on_child_event(event, body, namespace, labels, memo))


_register_drift_handlers()


# Autoscaling: one loop for the whole operator (autoscale_loop.py) ------------------------------------------------


@dataclass(frozen=True)
class AutoscaleSettings:
    interval: float = 5.0
    release_namespace: str = "kaon-system"
    """Where the routers run (their /metrics say which services hold requests) and the Lease lives."""
    use_lease: bool = False
    """Several operator replicas (peering): only the Lease holder autoscales."""


autoscale_settings = AutoscaleSettings()  # main.py sets it from the command line before kopf runs


@kopf.on.startup()
async def start_autoscaler(memo: kopf.Memo, **kwargs) -> None:
    state = _state(memo)

    def resync(key):  # the MetricsAvailable condition changed: write it with the others
        _resync(memo, key, kwargs["inference_services"], kwargs["engine_pods"], kwargs["engine_deployments"])

    loop = autoscale_loop.AutoscaleLoop(
        state.kube, kwargs, interval=autoscale_settings.interval,
        release_namespace=autoscale_settings.release_namespace, use_lease=autoscale_settings.use_lease,
        post=lambda body, events: _post(body, events, state.kube), resync=resync,
        conditions=state.metrics_conditions, identity=reporting_instance())
    _run_in_background(memo, loop.run())
