"""kopf registrations: each handler hands its event to the module that does the job.

- An InferenceService created, changed or found at start-up: reconciler.py applies its children
  and writes its status; deleted: its record is forgotten (the garbage collector removes the
  children through their owner references, even while the operator is down: no finalizer).
- A pod, the Deployment, the LeaderWorkerSet (multi-node) or the PDB changed: the status queue
  (status_queue.py) recomputes that service's status once per burst of events (status_sync.py).
- A child deleted or edited by someone else: drift.py applies it again.
- Start-up: kopf's settings (watching.py), the shared context in the memo (context.py) and the
  background tasks (background.py: status workers, startup watch, autoscale loop).

The index handlers' names are the caches' field names (caches.py); `reconcile` and `deleted`
keep their names, which kopf writes into its progress annotations.
"""
from __future__ import annotations

import asyncio

import kopf

from kaon_operator import background, reconciler, watching
from kaon_operator.api import Key
from kaon_operator.caches import Caches
from kaon_operator.children import drift, leaderworkerset
from kaon_operator.config import OperatorConfig
from kaon_operator.context import Context
from kaon_operator.kube import Kube
from kaon_operator.labels import SERVICE
from kaon_operator.status import status_sync, summaries
from kaon_operator.watching import (
    CHILD_KINDS,
    DEPLOYMENTS,
    ENGINE_CHILD,
    ISVC,
    PDBS,
    PODS,
    PREFILL_CHILD,
    ROUTES,
    configure,
)


def _context(memo: kopf.Memo) -> Context:
    return memo["context"]


def _key(namespace: str | None, name: str) -> Key:
    return Key(namespace or "", name)  # every kind watched here is namespaced


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs) -> None:
    configure(settings)
    kube = await asyncio.to_thread(Kube.from_environment)  # reads the kubeconfig or the pod's token
    memo["context"] = ctx = Context(config=memo.get("config") or OperatorConfig(), kube=kube,
                                    caches=Caches.from_kopf(kwargs))
    background.start(ctx)


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_) -> None:
    await _context(memo).stop()


# Indexes (caches.py): kopf keeps them current from its watches. --------------------------------------------------


@kopf.index(*ISVC)
def inference_services(namespace: str | None, name: str, body: kopf.Body, **_) -> dict:
    return {_key(namespace, name): body}


@kopf.index(*ROUTES)
def inference_routes(namespace: str | None, name: str, body: kopf.Body, **_) -> dict:
    """InferenceRoutes (issue 52): key_digests.py publishes their spec.auth keys' digests, as for a service."""
    return {_key(namespace, name): body}


@kopf.index(*ISVC)
def served_names(namespace: str | None, body: kopf.Body, **_) -> dict:
    """Namespace -> who serves which name there: the NameConflict condition."""
    return {namespace or "": summaries.served_name(body)}


@kopf.index(*PODS, labels=ENGINE_CHILD)
def engine_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    return {_key(namespace, labels[SERVICE]): summaries.summarize_pod(body)}


@kopf.index(*PODS, labels=PREFILL_CHILD)
def prefill_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    """spec.prefill's pods: the adapter loop loads spec.adapters on them too (docs/disaggregation.md)."""
    return {_key(namespace, labels[SERVICE]): summaries.summarize_pod(body)}


@kopf.index(*DEPLOYMENTS, labels=ENGINE_CHILD)
def engine_deployments(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    return {_key(namespace, labels[SERVICE]): summaries.summarize_deployment(body)}


@kopf.index(*DEPLOYMENTS, labels=PREFILL_CHILD)
def prefill_deployments(namespace: str | None, labels: kopf.Labels, body: kopf.Body, **_) -> dict:
    return {_key(namespace, labels[SERVICE]): summaries.summarize_deployment(body)}


# The InferenceService itself ----------------------------------------------------------------------------------------


@kopf.on.resume(*ISVC)
@kopf.on.create(*ISVC)
@kopf.on.update(*ISVC, field="spec")
def reconcile(body: kopf.Body, namespace: str | None, name: str, reason: str, old, memo: kopf.Memo, **_) -> None:
    reconciler.reconcile(_context(memo), body, _key(namespace, name), reason, old)


@kopf.on.delete(*ISVC, optional=True)
def deleted(namespace: str | None, name: str, memo: kopf.Memo, **_) -> None:
    _context(memo).records.forget(_key(namespace, name))


@kopf.on.event(*ISVC)
def served_names_changed(namespace: str | None, memo: kopf.Memo, **_) -> None:
    status_sync.served_names_changed(_context(memo), namespace or "")


# What the status is made of -----------------------------------------------------------------------------------------


@kopf.on.event(*PODS, labels=ENGINE_CHILD)
@kopf.on.event(*DEPLOYMENTS, labels=ENGINE_CHILD)
@kopf.on.event(*DEPLOYMENTS, labels=PREFILL_CHILD, id="prefill-status")
async def child_status_changed(namespace: str | None, labels: kopf.Labels, memo: kopf.Memo, **_) -> None:
    _context(memo).status_queue.mark(_key(namespace, labels[SERVICE]))


@kopf.on.event(*watching.LEADER_WORKER_SETS, labels=ENGINE_CHILD, id="group-status")
async def groups_changed(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, labels: kopf.Labels,
                         memo: kopf.Memo, **_) -> None:
    summary = None if event.get("type") == "DELETED" else leaderworkerset.summarize(body)
    status_sync.groups_changed(_context(memo), _key(namespace, labels[SERVICE]), summary)


@kopf.on.event(*PDBS, labels=ENGINE_CHILD, id="pdb-status")
async def pdb_status_changed(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, labels: kopf.Labels,
                             memo: kopf.Memo, **_) -> None:
    summary = None if event.get("type") == "DELETED" else summaries.summarize_pdb(body)
    status_sync.pdb_changed(_context(memo), _key(namespace, labels[SERVICE]), summary)


# Drift of the children ----------------------------------------------------------------------------------------------


def child_changed(event: kopf.RawEvent, body: kopf.Body, namespace: str | None, labels: kopf.Labels, memo: kopf.Memo,
                  **_) -> None:
    drift.child_changed(_context(memo), event, body, namespace or "", labels[SERVICE])


def _register_drift_handlers() -> None:
    for group, version, plural in CHILD_KINDS:
        kopf.on.event(group, version, plural, labels=ENGINE_CHILD, id=f"drift-{plural}")(child_changed)


_register_drift_handlers()
