"""Reconcile: render an InferenceService's children (Deployment, Service, PDB, and a
NetworkPolicy unless switched off) and server-side apply them at once (idempotent), then
recompute its status."""
from __future__ import annotations

import json

import kopf
from kubernetes.client.rest import ApiException

from kaon_operator import api, changes, resources, spec_policy, status, status_sync
from kaon_operator.context import Context
from kaon_operator.kube import NamespaceTerminating, NotOwned
from kaon_operator.metrics import RECONCILE_SECONDS

APPLY_RETRY_SECONDS = 10
CONFLICT_RETRY_SECONDS = 30  # until the object in the way is gone (then the children are applied)


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
        manifests = resources.render(owner, spec, ctx.config.network_policy)
        applying = [ctx.appliers.submit(ctx.kube.apply, m) for m in manifests]
        return [future.result() for future in applying]


def reconcile(ctx: Context, body, key: tuple[str, str], reason: str, old) -> None:
    """kopf's create, update (of the spec) and resume."""
    record = ctx.records.get(key)
    spec = api.parse_spec(body["spec"])
    if not isinstance(spec, str):
        spec = spec_policy.refusal(spec, ctx.config.spec_policy) or spec  # more than the admin allows: invalid
    if isinstance(spec, str):
        status_sync.write_invalid_spec(ctx, body, key, spec)
        return  # nothing to retry: the spec must change first, and that is another event
    version = (body["metadata"]["uid"], body["metadata"].get("generation"))
    if reason != "resume" and record.applied == version and record.apply_failure is None:
        # This generation's children are applied already: kopf handed over an event older than its own
        # last-handled-configuration annotation (watching.CONSISTENCY_SECONDS). Nothing to apply, no Event.
        status_sync.sync_status(ctx, body, key, spec, applied=True)
        return
    try:
        children = apply_children(ctx, body, spec)
    except NamespaceTerminating:
        return  # the InferenceService goes with its namespace
    except NotOwned as exc:
        # Never taken over, never deleted: reported (condition and Warning Event naming it), and tried again.
        record.conflict = str(exc)
        ctx.post(body, [status.EventSpec("Warning", status.RESOURCE_CONFLICT, record.conflict)])
        status_sync.sync_status(ctx, body, key, spec, applied=False)
        raise kopf.TemporaryError(record.conflict, delay=CONFLICT_RETRY_SECONDS) from None
    except ApiException as exc:
        # Say why in the status and an Event, then let kopf retry: quotas, admission webhooks
        # or a full Service IP range are fixed outside the spec.
        record.apply_failure = f"applying the children failed: {_api_message(exc)}"
        status_sync.sync_status(ctx, body, key, spec, applied=False)
        raise kopf.TemporaryError(record.apply_failure, delay=APPLY_RETRY_SECONDS) from None
    record.apply_failure, record.conflict, record.applied = None, None, version
    if reason == "create":
        ctx.post(body, [status.EventSpec("Normal", "Created", "created " + ", ".join(
            f"{c['kind']} {c['metadata']['name']}" for c in children))])
    elif reason == "update":
        previous = api.parse_spec(old) if old else None
        if isinstance(previous, api.InferenceServiceSpec):
            decision = (body.get("status") or {}).get("lastScaleDecision") or {}
            ctx.post(body, changes.describe_spec_change(previous, spec, autoscaled=decision.get("to") == spec.replicas))
    status_sync.sync_status(ctx, body, key, spec, applied=True)
