"""Reconcile: render an InferenceService's children (Deployment, Service, PDB, and a
NetworkPolicy unless switched off) and server-side apply them at once (idempotent), then
recompute its status; a multi-node one's control-channel key (a Secret) is created once, first.
Multi-node replicas need the LeaderWorkerSet API: without it nothing is applied and the status
names what to install."""
from __future__ import annotations

import json
import secrets

import kopf
from kubernetes.client.rest import ApiException

from kaon_operator import api, spec_policy
from kaon_operator.api import Key
from kaon_operator.children import changes, disagg_args, leaderworkerset, node_prefetch, prefill_pool, resources
from kaon_operator.context import Context
from kaon_operator.kube import NamespaceTerminating, NotOwned
from kaon_operator.metrics import RECONCILE_SECONDS
from kaon_operator.status import conditions, status_sync

APPLY_RETRY_SECONDS = 10
CONFLICT_RETRY_SECONDS = 30  # until the object in the way is gone (then the children are applied)
MISSING_API_RETRY_SECONDS = 30  # until the LeaderWorkerSet API is installed
_WORKLOADS = {False: ("apps/v1", "Deployment"), True: (leaderworkerset.API_VERSION, leaderworkerset.KIND)}


def _api_message(exc: ApiException) -> str:
    try:
        return json.loads(exc.body or "")["message"]
    except (TypeError, ValueError, KeyError):
        return f"{exc.status} {exc.reason}"


def apply_children(ctx: Context, body, spec: api.InferenceServiceSpec) -> list[dict]:
    """Apply every child at once; the objects as the apiserver holds them afterwards."""
    meta = body["metadata"]
    owner = resources.Owner(name=meta["name"], namespace=meta["namespace"], uid=meta["uid"])
    with RECONCILE_SECONDS.time():
        if spec.engine.multi_node:  # the group's control-channel key, before any pod that reads it
            ctx.kube.create_once(resources.dist_key_secret(owner, secrets.token_hex(32)))
        # The engine's admin key, which only the adapter and standby loops send (adapter_pods.py).
        if spec.adapters or (spec.autoscaling.enabled and spec.autoscaling.standby):
            ctx.kube.create_once(resources.admin_key_secret(owner, secrets.token_hex(32)))
        manifests = resources.render(owner, spec, ctx.config.network_policy)
        applying = [ctx.appliers.submit(ctx.kube.apply, m) for m in manifests]
        return [future.result() for future in applying]


def missing_api(ctx: Context, spec: api.InferenceServiceSpec) -> str | None:
    """What the cluster lacks for this spec (the LeaderWorkerSet API for multi-node replicas), in words."""
    if spec.engine.multi_node and not ctx.kube.serves(leaderworkerset.API_VERSION, leaderworkerset.KIND):
        return (f"engine.nodesPerReplica {spec.engine.nodes_per_replica} needs the LeaderWorkerSet API "
                f"({leaderworkerset.API_VERSION}), which this cluster does not serve: {leaderworkerset.INSTALL_HINT}")
    return None


def _remove_other_workload(ctx: Context, body, key: Key, spec: api.InferenceServiceSpec, old) -> None:
    """After a switch between one and several nodes per replica, the workload of the other kind goes
    (once the new one is applied; its pods drain as in any scale-down). Whether one stands: the previous spec
    says so (an update), else the watches (a resume). Not the LWS watch alone: it starts only once kopf has
    found the LWS API, which may be after the group was made, and a switch must not wait on it."""
    multi_node = spec.engine.multi_node
    previous = api.parse_spec(old) if old else None
    switched = isinstance(previous, api.InferenceServiceSpec) and previous.engine.multi_node != multi_node
    if not (switched or (ctx.caches.deployment(key) is not None if multi_node
                         else ctx.records.get(key).groups is not None)):
        return
    meta = body["metadata"]
    api_version, kind = _WORKLOADS[not spec.engine.multi_node]
    if ctx.kube.delete_controlled(api_version, kind, meta["namespace"], meta["name"], meta["uid"]):
        ctx.post(body, [conditions.EventSpec("Normal", "Replaced", f"deleted {kind} {meta['name']}: "
                                             f"engine.nodesPerReplica is {spec.engine.nodes_per_replica} now")])


def _remove_prefill_pool(ctx: Context, body, spec: api.InferenceServiceSpec, old) -> None:
    """spec.prefill removed: its Deployment, Service and NetworkPolicy go (the decode pods, re-rendered without
    --role decode, roll first)."""
    if spec.prefill is not None or not old or old.get("prefill") is None:
        return
    meta = body["metadata"]
    name = disagg_args.name_of(meta["name"])
    deleted = [kind for api_version, kind in prefill_pool.KINDS
               if ctx.kube.delete_controlled(api_version, kind, meta["namespace"], name, meta["uid"])]
    if deleted:
        ctx.post(body, [conditions.EventSpec("Normal", "PrefillPoolRemoved", f"deleted {', '.join(deleted)} {name}: "
                                             "spec.prefill is gone, the decode pods prefill every prompt")])


def _remove_prefetch(ctx: Context, body, spec: api.InferenceServiceSpec, old) -> None:
    """The node cache switched off (or the model no longer fetched): the prefetch DaemonSet goes."""
    if not node_prefetch.dropped(spec, api.parse_spec(old) if old else None):
        return
    meta = body["metadata"]
    name = node_prefetch.name_of(meta["name"])
    if ctx.kube.delete_controlled(node_prefetch.API_VERSION, node_prefetch.KIND, meta["namespace"], name, meta["uid"]):
        ctx.post(body, [conditions.EventSpec("Normal", "PrefetchRemoved", f"deleted DaemonSet {name}: the model "
                                             "is no longer prefetched to the nodes' cache")])


def reconcile(ctx: Context, body, key: Key, reason: str, old) -> None:
    """kopf's create, update (of the spec) and resume."""
    record = ctx.records.get(key)
    spec = spec_policy.checked(body["spec"], ctx.config.spec_policy)  # more than the admin allows: invalid
    if isinstance(spec, str):
        status_sync.write_invalid_spec(ctx, body, key, spec)
        return  # nothing to retry: the spec must change first, and that is another event
    version = (body["metadata"]["uid"], body["metadata"].get("generation"))
    if reason != "resume" and record.applied == version and record.apply_failure is None:
        # This generation's children are applied already: kopf handed over an event older than its own
        # last-handled-configuration annotation (watching.CONSISTENCY_SECONDS). Nothing to apply, no Event.
        status_sync.sync_status(ctx, body, key, spec, applied=True)
        return
    record.missing_api = missing_api(ctx, spec)
    if record.missing_api:  # nothing half-made: no child at all until the API is there
        status_sync.sync_status(ctx, body, key, spec, applied=False)
        raise kopf.TemporaryError(record.missing_api, delay=MISSING_API_RETRY_SECONDS)
    try:
        children = apply_children(ctx, body, spec)
    except NamespaceTerminating:
        return  # the InferenceService goes with its namespace
    except NotOwned as exc:
        # Never taken over, never deleted: reported (condition and Warning Event naming it), and tried again.
        record.conflict = str(exc)
        ctx.post(body, [conditions.EventSpec("Warning", conditions.RESOURCE_CONFLICT, record.conflict)])
        status_sync.sync_status(ctx, body, key, spec, applied=False)
        raise kopf.TemporaryError(record.conflict, delay=CONFLICT_RETRY_SECONDS) from None
    except ApiException as exc:
        # Say why in the status and an Event, then let kopf retry: quotas, admission webhooks
        # or a full Service IP range are fixed outside the spec.
        record.apply_failure = f"applying the children failed: {_api_message(exc)}"
        status_sync.sync_status(ctx, body, key, spec, applied=False)
        raise kopf.TemporaryError(record.apply_failure, delay=APPLY_RETRY_SECONDS) from None
    record.apply_failure, record.conflict, record.applied = None, None, version
    _remove_other_workload(ctx, body, key, spec, old)
    _remove_prefill_pool(ctx, body, spec, old)
    _remove_prefetch(ctx, body, spec, old)
    if reason == "create":
        ctx.post(body, [conditions.EventSpec("Normal", "Created", "created " + ", ".join(
            f"{c['kind']} {c['metadata']['name']}" for c in children)), *changes.ignored_settings(spec)])
    elif reason == "update":
        previous = api.parse_spec(old) if old else None
        if isinstance(previous, api.InferenceServiceSpec):
            autoscaled = record.scaled_to == spec.replicas  # the autoscaler's own change: it posted its Event
            if autoscaled:
                record.scaled_to = None
            ctx.post(body, changes.describe_spec_change(previous, spec, autoscaled=autoscaled)
                     + changes.newly_ignored(previous, spec))
    status_sync.sync_status(ctx, body, key, spec, applied=True)
