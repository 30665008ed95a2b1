"""Write an InferenceService's status: recompute its conditions and replica counts from the
caches, PATCH the status only when it changed, and post an Event for every condition that
flipped (conditions.py decides which).

Runs in kopf's handler threads and the status queue's workers; one service's writes are
serialised by its record's lock.
"""
from __future__ import annotations

import time
from datetime import datetime

from kaon_operator import api, clock
from kaon_operator.api import Key
from kaon_operator.children import resources
from kaon_operator.context import Context
from kaon_operator.metrics import STATUS_SECONDS
from kaon_operator.records import ServiceRecord
from kaon_operator.status import conditions, prefill_status
from kaon_operator.status.summaries import DeploymentSummary, PdbSummary, PodSummary


def _now() -> datetime:
    return clock.now().replace(microsecond=0)


def _write(ctx: Context, record: ServiceRecord, body, wanted: list[dict], pods: list[PodSummary],
           spec: api.InferenceServiceSpec | None, *, applied: bool) -> None:
    groups = record.groups if spec is not None and spec.engine.multi_node else None
    meta = body["metadata"]
    generation = meta.get("generation", 0)
    last = record.written or dict(body.get("status") or {})
    old_conditions = last.get("conditions") or []
    new = {"conditions": conditions.stamp(wanted, old_conditions, _now(), generation),
           **conditions.replica_counts(pods, groups), "selector": resources.selector(meta["name"])}
    new["observedGeneration"] = generation if applied else last.get("observedGeneration")
    if spec is not None and spec.prefill is not None:
        new.update(prefill_status.counts(ctx.caches.prefill_deployment(Key(meta["namespace"], meta["name"]))))
    if spec is not None:
        new["url"] = resources.service_url(resources.Owner(meta["name"], meta["namespace"], meta["uid"]))
    if {k: v for k, v in last.items() if k in new} == new:
        return
    ctx.kube.patch_status(meta["namespace"], meta["name"], new)
    record.written = new
    ctx.post(body, conditions.transition_events(new["conditions"], old_conditions))


def write_invalid_spec(ctx: Context, body, key: Key, message: str) -> None:
    record = ctx.records.get(key)
    with record.lock:
        _write(ctx, record, body, conditions.invalid_spec_conditions(message), [], None, applied=False)


def sync_status(ctx: Context, body, key: Key, spec: api.InferenceServiceSpec, *, applied: bool | None = None) -> None:
    start = time.perf_counter()
    record = ctx.records.get(key)
    with record.lock:
        if applied is None:  # not reconciling now: was the current generation applied before?
            last = record.written or body.get("status") or {}
            applied = last.get("observedGeneration") == body["metadata"].get("generation")
        pods = ctx.caches.pods(key)
        if record.conflict:
            wanted = conditions.resource_conflict_conditions(record.conflict)
        elif record.apply_failure:
            wanted = conditions.apply_failed_conditions(record.apply_failure)
        elif record.missing_api:
            wanted = conditions.missing_api_conditions(conditions.LWS_MISSING, record.missing_api)
        else:
            # Multi-node: the LeaderWorkerSet's groups stand where the Deployment's pods do.
            workload = record.groups if spec.engine.multi_node else ctx.caches.deployment(key)
            wanted = conditions.conditions(
                deployment=workload, pods=pods, desired=spec.replicas,
                gpus_per_pod=spec.engine.tensor_parallel_size, generation_applied=applied, now=_now())
        profiled = spec.autoscaling.enabled and spec.autoscaling.profile not in (None, "none")
        for type_, shown in ((conditions.METRICS, spec.autoscaling.enabled), (conditions.PROFILED, profiled),
                             (conditions.ADAPTERS_READY, bool(spec.adapters))):
            kept = record.conditions.get(type_)  # one read: a loop may replace it meanwhile
            if shown and kept is not None:
                wanted.append(kept)
        disruption = conditions.disruption_condition(record.pdb, pods, _now(),
                                                     desired=spec.replicas * spec.engine.nodes_per_replica)
        wanted += [disruption] if disruption else []
        # An older InferenceService answering this one's served name.
        conflict = conditions.name_conflicts(ctx.caches.served_names_in(key[0])).get(key)
        wanted += [conflict] if conflict else []
        if spec.prefill is not None:  # the prefill pool (docs/disaggregation.md)
            wanted.append(prefill_status.condition(ctx.caches.prefill_deployment(key), spec.prefill.replicas))
        _write(ctx, record, body, wanted, pods, spec, applied=applied)
    STATUS_SECONDS.observe(time.perf_counter() - start)


def resync(ctx: Context, key: Key) -> None:
    """Recompute the status of `key` as the caches hold it now (no-op for a service going away)."""
    body = ctx.caches.inference_service(key)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    spec = api.parse_spec(body["spec"])
    if isinstance(spec, api.InferenceServiceSpec):
        sync_status(ctx, body, key, spec)


def served_names_changed(ctx: Context, namespace: str) -> None:
    """An InferenceService came, went or changed its served name: the others of its namespace
    whose NameConflict changes get their status written again (an older one going away frees
    the name; a servedName edit can take one)."""
    peers = tuple(ctx.caches.served_names_in(namespace))
    if ctx.name_peers.get(namespace) == peers:
        return  # a status patch or another change that moves no name
    ctx.name_peers[namespace] = peers
    expected = conditions.name_conflicts(list(peers))
    for peer in peers:
        record = ctx.records.find(peer.key)
        written = next((c for c in ((record and record.written) or {}).get("conditions") or []
                        if c.get("type") == conditions.NAME_CONFLICT), None)
        want = expected.get(peer.key)
        if (written or {}).get("message") != (want or {}).get("message"):
            resync(ctx, peer.key)


def pdb_changed(ctx: Context, key: Key, summary: PdbSummary | None) -> None:
    """The PDB's status says whether evictions (node drains) are refused: DisruptionAllowed.
    `summary` is None once the PDB is gone."""
    if summary is None and ctx.caches.inference_service(key) is None:
        ctx.records.forget(key)  # garbage-collected with its InferenceService
        return
    record = ctx.records.get(key)
    if record.pdb != summary:
        record.pdb = summary
        ctx.status_queue.mark(key)


def groups_changed(ctx: Context, key: Key, summary: DeploymentSummary | None) -> None:
    """The LeaderWorkerSet's status (groups made, updated, ready) changed; None once it is gone."""
    record = ctx.records.find(key) if summary is None else ctx.records.get(key)
    if record is not None and record.groups != summary:
        record.groups = summary
        ctx.status_queue.mark(key)


def metrics_changed(ctx: Context, key: Key, condition: dict | None) -> None:
    """The autoscale loop's MetricsAvailable changed (None: the service is no longer autoscaled):
    write it with the others."""
    _loop_condition_changed(ctx, key, conditions.METRICS, condition, write=condition is not None)


def profile_changed(ctx: Context, key: Key, condition: dict | None) -> None:
    """The autoscale loop's Profiled changed (None: no profile, or no longer autoscaled): write it with the others."""
    _loop_condition_changed(ctx, key, conditions.PROFILED, condition)


def adapters_changed(ctx: Context, key: Key, condition: dict | None) -> None:
    """The adapter loop's AdaptersReady changed (None: no adapters): write it with the others."""
    _loop_condition_changed(ctx, key, conditions.ADAPTERS_READY, condition)


def _loop_condition_changed(ctx: Context, key: Key, type_: str, condition: dict | None, *, write: bool = True) -> None:
    """Keep a loop's condition of `type_` in the service's record (None: drop it) and, with `write`,
    resync its status."""
    if ctx.caches.inference_service(key) is None:
        ctx.records.forget(key)  # deleted meanwhile: no record to bring back
        return
    kept = ctx.records.get(key).conditions
    if condition is None:
        kept.pop(type_, None)
    else:
        kept[type_] = condition
    if write:
        resync(ctx, key)
