"""The operator's pure decisions: status conditions, their Events, spec-change Events, drift."""
from __future__ import annotations

from datetime import UTC, datetime, timedelta

from kaon_operator import api
from kaon_operator.children import changes
from kaon_operator.children.ownership import FIELD_MANAGER
from kaon_operator.status import conditions, summaries

SPEC = api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"}, "replicas": 2})


def pod(name="p", *, ready=True, unschedulable=None, waiting=None, deleting=False) -> dict:
    pod_conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable:
        pod_conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": unschedulable})
    containers = ([{"name": "engine", "state": {"waiting": {"reason": waiting, "message": "back-off"}}}]
                  if waiting else [])
    meta = {"name": name, **({"deletionTimestamp": "2026-01-01T00:00:00Z"} if deleting else {})}
    return {"metadata": meta, "status": {"conditions": pod_conditions, "containerStatuses": containers}}


def deployment(replicas=2, *, total=None, updated=None, ready=None, generation=1, observed=1):
    updated = replicas if updated is None else updated
    ready = updated if ready is None else ready
    return summaries.summarize_deployment({
        "metadata": {"generation": generation}, "spec": {"replicas": replicas},
        "status": {"observedGeneration": observed, "replicas": updated if total is None else total,
                   "updatedReplicas": updated, "readyReplicas": ready, "availableReplicas": ready}})


def by_type(conds: list[dict]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conds}


def test_pod_summaries():
    assert summaries.summarize_pod(pod()).ready
    stuck = summaries.summarize_pod(pod(ready=False, waiting="CrashLoopBackOff"))
    assert stuck.stuck[0] == "CrashLoopBackOff" and not stuck.ready
    assert summaries.summarize_pod(pod(ready=False, waiting="ContainerCreating")).stuck is None  # on its way
    pending = summaries.summarize_pod(pod(ready=False, unschedulable="0/4 nodes are available"))
    assert pending.unschedulable == "0/4 nodes are available"
    assert summaries.summarize_pod(pod(deleting=True)).terminating


def test_conditions_through_a_life():
    def conds(dep, pods, desired=2, applied=True):
        return by_type(conditions.conditions(deployment=dep, pods=[summaries.summarize_pod(p) for p in pods],
                                             desired=desired, gpus_per_pod=1, generation_applied=applied))

    assert conds(None, []) == {"Ready": ("False", "ReplicasNotReady"), "Progressing": ("True", "Reconciling"),
                               "Degraded": ("False", "AsExpected")}
    assert conds(deployment(updated=1, ready=1), [pod("a"), pod("b", ready=False)])["Progressing"] == \
        ("True", "ScalingUp")
    assert conds(deployment(ready=1), [pod("a"), pod("b", ready=False)])["Progressing"] == \
        ("True", "ReplicasStarting")
    assert conds(deployment(total=3, updated=1, ready=3), [pod("a"), pod("b"), pod("c")])["Progressing"] == \
        ("True", "RollingOut")
    assert conds(deployment(total=3, updated=3), [pod("a"), pod("b"), pod("c")])["Progressing"] == \
        ("True", "ScalingDown")
    assert conds(deployment(), [pod("a"), pod("b")]) == {
        "Ready": ("True", "AllReplicasReady"), "Progressing": ("False", "RolloutComplete"),
        "Degraded": ("False", "AsExpected")}
    # A new generation not yet applied is progress, even with every pod ready.
    assert conds(deployment(), [pod("a"), pod("b")], applied=False)["Progressing"] == ("True", "Reconciling")
    assert conds(deployment(generation=2, observed=1), [pod("a"), pod("b")])["Progressing"] == ("True", "Reconciling")
    # One ready replica serves (Ready, partially); a terminating pod is no capacity.
    assert conds(deployment(), [pod("a"), pod("b", deleting=True)])["Ready"] == ("True", "PartiallyReady")
    assert conds(deployment(), [pod("a", ready=False), pod("b", deleting=True)])["Ready"] == \
        ("False", "ReplicasNotReady")
    assert conds(deployment(0), [], desired=0)["Ready"] == ("False", "ScaledToZero")


def test_degraded_reasons_name_the_cause():
    def degraded(pods, dep=None):
        out = conditions.conditions(deployment=dep or deployment(ready=0),
                                    pods=[summaries.summarize_pod(p) for p in pods],
                                    desired=2, gpus_per_pod=16, generation_applied=True)
        return next(c for c in out if c["type"] == "Degraded")

    unschedulable = degraded([pod("a", ready=False,
                                  unschedulable="0/4 nodes are available: 4 Insufficient nvidia.com/gpu.")])
    assert unschedulable["reason"] == "Unschedulable"
    assert unschedulable["message"].startswith("1 pod(s) need 16 nvidia.com/gpu each and cannot be placed: 0/4 nodes")
    crash = degraded([pod("a", ready=False, waiting="CrashLoopBackOff"),
                      pod("b", ready=False, waiting="CrashLoopBackOff")])
    assert crash["reason"] == "CrashLoopBackOff" and crash["message"].startswith("2 pod(s) failing; a:")
    assert degraded([pod("a", ready=False, waiting="ImagePullBackOff")])["reason"] == "ImagePullBackOff"
    # Scheduling comes first: it is the cause to fix before any container can start.
    both = degraded([pod("a", ready=False, waiting="CrashLoopBackOff"), pod("b", ready=False, unschedulable="no")])
    assert both["reason"] == "Unschedulable"
    stalled = summaries.summarize_deployment({"metadata": {"generation": 1}, "spec": {"replicas": 2}, "status": {
        "conditions": [{"type": "Progressing", "status": "False", "reason": "ProgressDeadlineExceeded"}]}})
    assert degraded([pod("a", ready=False)], stalled)["reason"] == "ProgressDeadlineExceeded"
    assert degraded([pod("a", ready=False, waiting="CrashLoopBackOff", deleting=True)])["reason"] == "AsExpected"


def test_transition_times_and_events():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    progressing = conditions.conditions(deployment=None, pods=[], desired=1, gpus_per_pod=1, generation_applied=True)
    first = conditions.stamp(progressing, [], t0, 1)
    assert {c["lastTransitionTime"] for c in first} == {"2026-01-01T00:00:00Z"}
    assert conditions.transition_events(first, []) == []  # nothing to announce while merely starting

    ready_pods = [summaries.summarize_pod(pod())]
    ready = conditions.stamp(conditions.conditions(deployment=deployment(1, updated=1, ready=1), pods=ready_pods,
                                                   desired=1, gpus_per_pod=1, generation_applied=True),
                             first, t0 + timedelta(seconds=5), 1)
    times = {c["type"]: c["lastTransitionTime"] for c in ready}
    assert times["Ready"] == "2026-01-01T00:00:05Z" and times["Degraded"] == "2026-01-01T00:00:00Z"
    assert conditions.transition_events(ready, first) == [conditions.EventSpec("Normal", "Ready", "1/1 replicas ready")]
    assert conditions.transition_events(ready, ready) == []  # a repeat is silent

    crashing = [summaries.summarize_pod(pod(ready=False, waiting="CrashLoopBackOff"))]
    bad = conditions.conditions(deployment=deployment(1, ready=0), pods=crashing, desired=1, gpus_per_pod=1,
                                generation_applied=True)
    events = conditions.transition_events(bad, ready)
    assert [(e.type, e.reason) for e in events] == [("Warning", "NotReady"), ("Warning", "CrashLoopBackOff")]
    pulling = [summaries.summarize_pod(pod(ready=False, waiting="ImagePullBackOff"))]
    worse = conditions.conditions(deployment=deployment(1, ready=0), pods=pulling, desired=1, gpus_per_pod=1,
                                  generation_applied=True)
    assert [e.reason for e in conditions.transition_events(worse, bad)] == ["ImagePullBackOff"]  # a new cause is news
    assert [e.reason for e in conditions.transition_events(ready, worse)] == ["Ready", "Recovered"]

    rolling = conditions.conditions(deployment=deployment(1, total=2, ready=2), pods=ready_pods,
                                    desired=1, gpus_per_pod=1, generation_applied=True)
    assert conditions.transition_events(rolling, ready) == []
    assert conditions.transition_events(ready, rolling) == [
        conditions.EventSpec("Normal", "RolloutComplete", "1 replicas up to date")]


def test_replica_counts_skip_terminating_pods():
    pods = [summaries.summarize_pod(p) for p in (pod("a"), pod("b", ready=False), pod("c", deleting=True))]
    assert conditions.replica_counts(pods) == {"replicas": 2, "readyReplicas": 1, "standbyReplicas": 0}


def test_spec_change_events():
    def change(**edits):
        return [(e.reason, e.message) for e in changes.describe_spec_change(
            SPEC, SPEC.model_copy(update=edits, deep=True))]

    image = SPEC.engine.model_copy(update={"image": "x/kaon:2"})
    assert change(engine=image) == [("RollingOut", "spec changed (engine.image): rolling out new engine pods")]
    assert change(replicas=5) == [("Scaled", "Scaled 2 → 5 (spec.replicas)")]
    both = change(engine=image, replicas=3)
    assert [r for r, _ in both] == ["RollingOut", "Scaled"] and "replicas" not in both[0][1]
    scaling = SPEC.autoscaling.model_copy(update={"max_replicas": 8})
    assert change(autoscaling=scaling) == [("Updated", "spec changed (autoscaling.maxReplicas); pods unchanged")]
    assert change() == []


def test_standby_with_autoscaling_off_is_a_warning_saying_what_to_change():
    asleep = SPEC.model_copy(update={"autoscaling": SPEC.autoscaling.model_copy(
        update={"enabled": False, "standby": 2})}, deep=True)
    [warning] = changes.ignored_settings(asleep)
    assert (warning.type, warning.reason) == ("Warning", "StandbyIgnored")
    assert "autoscaling.standby 2 has no effect" in warning.message
    assert "set autoscaling.enabled true" in warning.message
    on = SPEC.model_copy(update={"autoscaling": SPEC.autoscaling.model_copy(
        update={"enabled": True, "standby": 2})}, deep=True)
    assert changes.ignored_settings(on) == changes.ignored_settings(SPEC) == []
    # said when a change brings it (autoscaling turned off), not again on a later unrelated edit
    assert changes.newly_ignored(on, asleep) == [warning] and changes.newly_ignored(None, asleep) == [warning]
    assert changes.newly_ignored(asleep, asleep.model_copy(update={"replicas": 3})) == []


def test_foreign_spec_managers():
    entries = [
        {"manager": FIELD_MANAGER, "operation": "Apply", "fieldsV1": {"f:spec": {}}},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status",
         "fieldsV1": {"f:status": {}}},
        {"manager": "kube-controller-manager", "operation": "Update",
         "fieldsV1": {"f:metadata": {"f:annotations": {}}}},
    ]
    assert changes.foreign_spec_managers(entries) == []
    edited = entries + [{"manager": "kubectl-edit", "operation": "Update", "fieldsV1": {"f:spec": {"f:replicas": {}}}},
                        {"manager": "kubectl", "operation": "Update", "subresource": "scale",
                         "fieldsV1": {"f:spec": {"f:replicas": {}}}}]
    assert changes.foreign_spec_managers(edited) == ["kubectl", "kubectl-edit"]
    assert changes.foreign_spec_managers(None) == []


# Failures read from what the kubelet and the controllers report ------------------------------------------------


def engine_status(state: dict, last: dict | None = None, restarts: int = 3) -> dict:
    return {"metadata": {"name": "llama-0"}, "status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "False"}], "containerStatuses": [
        {"name": "engine", "restartCount": restarts, "state": state,
         **({"lastState": {"terminated": last}} if last else {})}]}}


def degraded(pods=(), dep=None, now=None) -> dict:
    conds = conditions.conditions(deployment=dep, pods=[summaries.summarize_pod(p) for p in pods], desired=1,
                                  gpus_per_pod=1, generation_applied=True, now=now)
    return next(c for c in conds if c["type"] == "Degraded")


BACK_OFF = {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container=engine"}}


def test_a_crash_loop_says_the_exit_code_and_the_engines_last_line():
    log = "Traceback...\nkaon: error: builtin://does-not-exist: no such builtin model\n"
    cond = degraded([engine_status(BACK_OFF, {"exitCode": 2, "reason": "Error", "message": log})])
    assert (cond["status"], cond["reason"]) == ("True", "CrashLoopBackOff")
    assert cond["message"] == ("1 pod(s) failing; llama-0: container engine exited with code 2 (3 restart(s)): "
                               "kaon: error: builtin://does-not-exist: no such builtin model")
    # without a termination message the kubelet's own words remain
    bare = degraded([engine_status(BACK_OFF)])
    assert bare["reason"] == "CrashLoopBackOff" and "back-off 40s" in bare["message"]


def test_oom_killed_is_its_own_reason_until_the_container_is_ready_again():
    oom = {"exitCode": 137, "reason": "OOMKilled"}
    for state, last in ((BACK_OFF, oom), ({"terminated": oom}, None)):
        cond = degraded([engine_status(state, last)])
        assert cond["reason"] == "OOMKilled", cond
        assert "more memory than its limit" in cond["message"] and "exit code 137" in cond["message"]
    # running again between back-offs: still failing until ready, so Degraded does not flap
    assert degraded([engine_status({"running": {}}, oom)])["reason"] == "OOMKilled"
    back_up = engine_status({"running": {}}, oom)
    back_up["status"]["containerStatuses"][0]["ready"] = True
    assert degraded([back_up])["status"] == "False"  # it came back up


def test_a_crash_loop_stays_degraded_while_the_container_runs_again_until_ready():
    crashed = {"exitCode": 2, "reason": "Error", "message": "kaon: error: no such model"}
    cond = degraded([engine_status({"running": {}}, crashed)])
    assert cond["reason"] == "CrashLoopBackOff" and cond["message"].endswith(": kaon: error: no such model"), cond
    ready = engine_status({"running": {}}, crashed)
    ready["status"]["containerStatuses"][0]["ready"] = True
    assert degraded([ready])["status"] == "False"
    pod_ready = engine_status({"running": {}}, crashed)  # a runtime that sets only the pod's Ready condition
    pod_ready["status"]["conditions"] = [{"type": "Ready", "status": "True"}]
    assert degraded([pod_ready])["status"] == "False"
    assert degraded([engine_status({"running": {}}, {"exitCode": 0, "reason": "Completed"})])["status"] == "False"


def test_pods_refused_by_a_quota_are_failed_create_from_the_deployments_replica_failure():
    refused = 'pods "llama-7d9-x" is forbidden: exceeded quota: gpus, requested: requests.nvidia.com/gpu=1'
    dep = summaries.summarize_deployment({"metadata": {"generation": 1}, "spec": {"replicas": 1}, "status": {
        "observedGeneration": 1, "conditions": [
            {"type": "Available", "status": "False"},
            {"type": "ReplicaFailure", "status": "True", "reason": "FailedCreate", "message": refused}]}})
    assert dep.replica_failure == refused
    cond = degraded([], dep)
    assert cond["reason"] == "FailedCreate" and cond["message"] == f"the ReplicaSet cannot create pods: {refused}"
    assert deployment().replica_failure is None and degraded([], deployment())["status"] == "False"


def slow_pod(since: str, *, ready="False") -> dict:
    probe = {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 10, "failureThreshold": 6}
    return {"metadata": {"name": "slow-0"},
            "spec": {"containers": [{"name": "engine", "startupProbe": probe,
                                     "readinessProbe": {"periodSeconds": 5, "failureThreshold": 2}}]},
            "status": {"phase": "Running", "startTime": "2026-01-01T00:00:00Z", "conditions": [
                {"type": "Ready", "status": ready, "lastTransitionTime": since}],
                "containerStatuses": [{"name": "engine", "restartCount": 0, "state": {"running": {}}}]}}


def test_a_pod_not_ready_past_its_probes_budget_is_startup_timeout():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    summary = summaries.summarize_pod(slow_pod("2026-01-01T00:00:00Z"))
    assert summary.startup_budget_s == 70  # 6 x 10 s startup + 2 x 5 s readiness
    assert conditions.next_startup_deadline([summary]) == t0 + timedelta(seconds=70)
    assert degraded([slow_pod("2026-01-01T00:00:00Z")], now=t0 + timedelta(seconds=69))["status"] == "False"
    cond = degraded([slow_pod("2026-01-01T00:00:00Z")], now=t0 + timedelta(seconds=71))
    assert (cond["status"], cond["reason"]) == ("True", "StartupTimeout")
    assert ("70 s their probes allow" in cond["message"]
            and "slow-0: not ready since 2026-01-01T00:00:00Z" in cond["message"])
    # judged from when it last became not ready, and never without a clock or once ready
    assert degraded([slow_pod("2026-01-01T00:01:00Z")], now=t0 + timedelta(seconds=71))["status"] == "False"
    assert degraded([slow_pod("2026-01-01T00:00:00Z")])["status"] == "False"
    ready = slow_pod("2026-01-01T00:00:00Z", ready="True")
    assert degraded([ready], now=t0 + timedelta(hours=1))["status"] == "False"
    assert conditions.next_startup_deadline([summaries.summarize_pod(ready)]) is None


def test_each_failure_posts_one_warning_and_recovery_one_normal_event():
    crash = conditions.conditions(deployment=None,
                                  pods=[summaries.summarize_pod(engine_status(BACK_OFF, {"exitCode": 1}))],
                                  desired=1, gpus_per_pod=1, generation_applied=True)
    first = conditions.transition_events(crash, [])
    assert [(e.type, e.reason) for e in first if e.type == "Warning"] == [("Warning", "CrashLoopBackOff")]
    assert conditions.transition_events(crash, crash) == []  # the same failure on the next tick: no new Event
    oom = conditions.conditions(deployment=None, pods=[summaries.summarize_pod(engine_status(BACK_OFF, {
        "exitCode": 137, "reason": "OOMKilled"}))], desired=1, gpus_per_pod=1, generation_applied=True)
    assert [(e.type, e.reason) for e in conditions.transition_events(oom, crash)] == [("Warning", "OOMKilled")]
    healthy = conditions.conditions(deployment=None, pods=[summaries.summarize_pod(pod())], desired=1, gpus_per_pod=1,
                                    generation_applied=True)
    assert ("Normal", "Recovered", "no longer degraded (OOMKilled)") in [
        (e.type, e.reason, e.message) for e in conditions.transition_events(healthy, oom)]


def killed_pod(*, ready_changed: str, restarts: int = 1, state: dict | None = None, ready: bool = False) -> dict:
    """A pod whose engine was killed by the kubelet (exit 137) and runs again; its Ready condition last
    changed at `ready_changed` (the pod started at midnight)."""
    return {"metadata": {"name": "llama-0"}, "status": {
        "phase": "Running", "startTime": "2026-01-01T00:00:00Z",
        "conditions": [{"type": "Ready", "status": "True" if ready else "False", "lastTransitionTime": ready_changed}],
        "containerStatuses": [{"name": "engine", "restartCount": restarts, "ready": ready,
                               "state": state or {"running": {}},
                               "lastState": {"terminated": {"exitCode": 137, "reason": "Error",
                                                            "message": "INFO: loading weights"}}}]}}


def test_a_container_killed_before_it_was_ever_ready_is_startup_timeout():
    cond = degraded([killed_pod(ready_changed="2026-01-01T00:00:00Z")])
    assert (cond["status"], cond["reason"]) == ("True", "StartupTimeout"), cond
    assert "killed (SIGKILL) before it ever became ready (1 restart(s))" in cond["message"]
    assert "spec.engine.startupTimeoutSeconds" in cond["message"] and cond["message"].endswith("INFO: loading weights")
    # in back-off between the kills it is the same failure
    assert degraded([killed_pod(ready_changed="2026-01-01T00:00:00Z", state=BACK_OFF)])["reason"] == "StartupTimeout"


def test_a_container_killed_after_it_had_served_is_unhealthy_until_ready_again():
    # Ready turned False an hour after the start: it served, then its liveness probe failed.
    hung = killed_pod(ready_changed="2026-01-01T01:00:00Z")
    cond = degraded([hung])
    assert (cond["status"], cond["reason"]) == ("True", "Unhealthy"), cond
    assert "liveness probe failed" in cond["message"] and "spec.engine.stallTimeoutSeconds" in cond["message"]
    events = conditions.transition_events(conditions.conditions(deployment=None, pods=[summaries.summarize_pod(hung)],
                                                        desired=1, gpus_per_pod=1, generation_applied=True), [])
    assert [(e.type, e.reason) for e in events if e.type == "Warning"] == [("Warning", "Unhealthy")]
    back = killed_pod(ready_changed="2026-01-01T01:01:00Z", ready=True)
    assert degraded([back])["status"] == "False"  # restarted and ready: recovered
    # a clean exit (0) is no kill, and an engine's own error exit stays a crash loop
    assert _exit(0)["status"] == "False" and _exit(2)["reason"] == "CrashLoopBackOff"


def _exit(code: int) -> dict:
    pod_ = killed_pod(ready_changed="2026-01-01T01:00:00Z")
    pod_["status"]["containerStatuses"][0]["lastState"]["terminated"]["exitCode"] = code
    return degraded([pod_])


def pdb(allowed: int, healthy: int, desired: int, expected: int = 3) -> summaries.PdbSummary:
    return summaries.summarize_pdb({"metadata": {"generation": 1}, "status": {
        "observedGeneration": 1, "disruptionsAllowed": allowed, "currentHealthy": healthy,
        "desiredHealthy": desired, "expectedPods": expected}})


def test_a_pdb_refusing_evictions_is_disruption_allowed_false_with_one_warning():
    crashing = [summaries.summarize_pod(engine_status(BACK_OFF, {"exitCode": 2}))]
    blocked = conditions.disruption_condition(pdb(0, 0, 2), crashing)
    assert (blocked["status"], blocked["reason"]) == ("False", "InsufficientHealthyReplicas")
    assert blocked["message"].startswith("evictions of every engine pod are refused") and "0 are" in blocked["message"]
    assert "scale-downs and rollouts delete pods directly and are not blocked" in blocked["message"]
    # at the budget: ready pods cannot be evicted, the unhealthy one could
    at_budget = conditions.disruption_condition(pdb(0, 2, 2), crashing)
    assert at_budget["reason"] == "InsufficientHealthyReplicas" and at_budget["message"].startswith(
        "evictions of ready engine pods")
    fine = conditions.disruption_condition(pdb(1, 3, 2), [summaries.summarize_pod(pod())])
    assert (fine["status"], fine["reason"]) == ("True", "SufficientHealthyReplicas")
    # a single replica (minAvailable 0) crash-looping blocks nothing; no PDB or no status yet: no condition
    assert conditions.disruption_condition(pdb(0, 0, 0, expected=1), crashing)["status"] == "True"
    assert conditions.disruption_condition(None, crashing) is None
    assert conditions.disruption_condition(pdb(0, 0, 0, expected=0), []) is None

    events = conditions.transition_events([blocked], [])
    assert [(e.type, e.reason) for e in events] == [("Warning", "DisruptionBlocked")]
    assert conditions.transition_events([blocked], [blocked]) == []
    assert ([(e.type, e.reason) for e in conditions.transition_events([fine], [blocked])]
            == [("Normal", "DisruptionAllowed")])


def test_a_scale_up_from_one_replica_is_no_disruption_warning():
    # 1 -> 3: minAvailable goes 0 -> 1 while the one pod is ready and the new pods are not created yet
    # (seen in `make demo`: a Warning DisruptionBlocked on every scale-up from one replica).
    ready = [summaries.summarize_pod(pod())]
    cond = conditions.disruption_condition(pdb(0, 1, 1, expected=1), ready, desired=3)
    assert (cond["status"], cond["reason"]) == ("False", "ReplicasStarting")
    assert conditions.transition_events([cond], []) == []
    # every wanted pod there and ready, yet the budget refuses (minAvailable = replicas): that is one to see
    held = conditions.disruption_condition(pdb(0, 1, 1, expected=1), ready, desired=1)
    assert held["reason"] == "InsufficientHealthyReplicas"


def test_replicas_still_starting_block_evictions_quietly():
    t0 = datetime(2026, 1, 1, tzinfo=UTC)
    starting = [summaries.summarize_pod(slow_pod("2026-01-01T00:00:00Z"))]  # 70 s budget
    cond = conditions.disruption_condition(pdb(0, 1, 1), starting, now=t0 + timedelta(seconds=10))
    assert (cond["status"], cond["reason"]) == ("False", "ReplicasStarting")
    assert conditions.transition_events([cond], []) == []  # a scale-up is no incident
    overdue = conditions.disruption_condition(pdb(0, 1, 1), starting, now=t0 + timedelta(seconds=71))
    assert overdue["reason"] == "InsufficientHealthyReplicas"
    assert [e.reason for e in conditions.transition_events([overdue], [cond])] == ["DisruptionBlocked"]
