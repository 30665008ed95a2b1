"""The operator's per-service memory without a cluster: a reconcile against a fake API client and
caches, one record per InferenceService, forgotten once and never brought back by late events."""
from __future__ import annotations

from kaon_operator import reconciler
from kaon_operator.caches import Caches
from kaon_operator.config import NetworkPolicyConfig, OperatorConfig
from kaon_operator.context import Context
from kaon_operator.status import status_sync, summaries

KEY = ("ns", "llama")
METRICS = {"type": "MetricsAvailable", "status": "True", "reason": "Scraped",
           "message": "1 of 1 ready replicas answered"}


class FakeKube:
    def __init__(self):
        self.applied, self.statuses, self.events = [], [], []

    def apply(self, manifest):
        self.applied.append(manifest["kind"])
        return {**manifest, "metadata": {**manifest["metadata"], "resourceVersion": "1"}}

    def patch_status(self, namespace, name, status, resource_version=None):
        self.statuses.append(status)
        return {}

    def post_event(self, body, type_, reason, message, instance):
        self.events.append(reason)


def isvc(generation=1, **spec):
    return {"metadata": {"name": KEY[1], "namespace": KEY[0], "uid": "u1", "generation": generation,
                         "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"uri": "builtin://x"}, **spec}}


def context(*bodies, network_policy=True):
    services = {(b["metadata"]["namespace"], b["metadata"]["name"]): [b] for b in bodies}
    served = {}
    for b in bodies:
        served.setdefault(b["metadata"]["namespace"], []).append(summaries.served_name(b))
    config = OperatorConfig(network_policy=NetworkPolicyConfig("kaon-system") if network_policy else None)
    return Context(config=config, kube=FakeKube(), caches=Caches(inference_services=services, served_names=served))


def test_a_reconcile_applies_the_children_once_per_generation_and_writes_the_status():
    body = isvc()
    ctx = context(body)
    reconciler.reconcile(ctx, body, KEY, "create", None)
    assert ctx.kube.applied == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    assert ctx.kube.events == ["Created"]  # outside kopf: posted through the API client
    assert [c["reason"] for c in ctx.kube.statuses[-1]["conditions"]] == ["ReplicasNotReady", "Reconciling",
                                                                         "AsExpected"]
    assert ctx.records.get(KEY).applied == ("u1", 1)
    reconciler.reconcile(ctx, body, KEY, "create", None)  # an older event for the same generation
    assert len(ctx.kube.applied) == 4
    reconciler.reconcile(ctx, body, KEY, "resume", None)  # the operator restarted: apply again
    assert len(ctx.kube.applied) == 8


def test_no_network_policy_when_switched_off_and_an_invalid_spec_is_reported_not_applied():
    ctx = context(isvc(), network_policy=False)
    reconciler.reconcile(ctx, isvc(), KEY, "create", None)
    assert "NetworkPolicy" not in ctx.kube.applied
    invalid = isvc(generation=2, replicas=-1)
    reconciler.reconcile(ctx, invalid, KEY, "update", isvc()["spec"])
    assert len(ctx.kube.applied) == 3
    assert {c["reason"] for c in ctx.kube.statuses[-1]["conditions"]} == {"InvalidSpec"}


def test_the_autoscalers_condition_is_written_with_the_others_and_dropped_with_autoscaling():
    body = isvc(autoscaling={"enabled": True})
    ctx = context(body)
    reconciler.reconcile(ctx, body, KEY, "create", None)
    status_sync.metrics_changed(ctx, KEY, METRICS)
    assert METRICS.items() <= ctx.kube.statuses[-1]["conditions"][-1].items()
    status_sync.metrics_changed(ctx, KEY, None)
    assert "MetricsAvailable" not in ctx.records.get(KEY).conditions


def test_the_record_says_whose_replica_change_an_update_is():
    """The autoscaler posts its own Scaled Event (with its reason): the update its spec.replicas write
    causes posts none, a human's `kubectl scale` does. The record says which, not the status."""
    ctx = context(isvc(replicas=1))
    reconciler.reconcile(ctx, isvc(replicas=1), KEY, "create", None)
    ctx.records.get(KEY).scaled_to = 3  # the autoscale loop, as it writes spec.replicas
    reconciler.reconcile(ctx, isvc(generation=2, replicas=3), KEY, "update", isvc(replicas=1)["spec"])
    assert ctx.kube.events == ["Created"] and ctx.records.get(KEY).scaled_to is None
    reconciler.reconcile(ctx, isvc(generation=3, replicas=5), KEY, "update", isvc(replicas=3)["spec"])
    assert ctx.kube.events == ["Created", "Scaled"]


def test_a_deleted_service_is_forgotten_and_late_events_do_not_bring_it_back():
    body = isvc()
    ctx = context(body)
    reconciler.reconcile(ctx, body, KEY, "create", None)
    ctx.records.forget(KEY)
    assert ctx.records.find(KEY) is None
    gone = context()  # the caches no longer hold it either
    gone.records.get(KEY)  # a record left by an event that raced the deletion
    status_sync.pdb_changed(gone, KEY, None)  # its PDB garbage-collected
    assert gone.records.find(KEY) is None
    gone.records.get(KEY)
    status_sync.metrics_changed(gone, KEY, METRICS)  # the autoscale loop's last tick
    assert gone.records.find(KEY) is None and gone.kube.statuses == []


def test_a_record_made_again_by_a_round_that_raced_the_deletion_is_swept():
    from kaon_operator.background import forget_the_gone

    ctx = context(isvc())
    ctx.records.get(KEY)
    ctx.records.get(("ns", "gone")).scaled_to = 2  # a loop's round read the caches just before the deletion
    forget_the_gone(ctx)
    assert ctx.records.find(KEY) is not None and ctx.records.find(("ns", "gone")) is None


def test_a_pdb_change_queues_one_status_update():
    body = isvc()
    ctx = context(body)
    pdb = summaries.summarize_pdb({"metadata": {"generation": 1}, "status": {
        "disruptionsAllowed": 0, "currentHealthy": 1, "desiredHealthy": 1, "expectedPods": 1, "observedGeneration": 1}})
    status_sync.pdb_changed(ctx, KEY, pdb)
    status_sync.pdb_changed(ctx, KEY, pdb)  # unchanged: not queued again
    assert ctx.status_queue.queued == {KEY} and ctx.status_queue.queue.qsize() == 1
    assert ctx.records.get(KEY).pdb == pdb
