"""Pure functions from what the cluster shows to an InferenceService's status and Events.

The handlers feed in summaries of the Deployment and its pods (taken from watch caches)
and the conditions last written; out come the new status and the Events an admin should
see for each condition that changed. No I/O here, so every rule is testable in microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import NamedTuple

from kaon_operator import naming

# Container waiting reasons that mean the pod will not become ready on its own.
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError")


@dataclass(frozen=True, slots=True)
class PodSummary:
    name: str
    ip: str | None = None
    ready: bool = False
    terminating: bool = False
    unschedulable: str | None = None
    """The scheduler's message while the pod cannot be placed."""
    stuck: tuple[str, str] | None = None
    """(reason, message) of a container that will not start, e.g. CrashLoopBackOff."""
    model_failure: tuple[str, str] | None = None
    """(ModelFetchFailed or ModelDoesNotFit, the one-line reason) when the fetch init container or the
    engine said why the model cannot be served (their termination message)."""
    not_ready_since: datetime | None = None
    """When a Running pod's Ready condition last turned False (else its start), while it is not ready."""
    startup_budget_s: float | None = None
    """How long the pod's own probes allow before it must be ready: the startup probe's whole budget
    plus the readiness probe's failures."""


@dataclass(frozen=True, slots=True)
class DeploymentSummary:
    generation: int
    observed_generation: int
    replicas: int
    """Desired replicas (the Deployment's spec)."""
    total: int
    """Pods of every ReplicaSet, old template or new."""
    updated: int
    ready: int
    available: int
    progress_deadline_exceeded: bool = False
    replica_failure: str | None = None
    """The ReplicaSet cannot create pods (its ReplicaFailure condition, which the Deployment controller
    copies to the Deployment): a ResourceQuota or LimitRange refused them, with the apiserver's words."""


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(slots=True)
class StatusUpdate:
    status: dict
    events: list[EventSpec] = field(default_factory=list)


ROLLOUT_NEEDS_SPARE_GPUS = ("; the rollout (spec.rollout.strategy Surge) starts each new pod before stopping an old "
                            "one and waits for spare GPUs: Replace rolls out on the GPUs the old pods free")
FETCH_CONTAINER = "fetch"  # resources.py's init container: `kaon fetch`
DOES_NOT_FIT = "model does not fit"  # how `kaon fetch` and `kaon serve` begin that reason


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _failed(container: dict) -> dict | None:
    """The terminated state of a container's latest failed run, unless it has since succeeded."""
    state = container.get("state") or {}
    if (state.get("terminated") or {}).get("exitCode") == 0:
        return None
    for terminated in (state.get("terminated"), (container.get("lastState") or {}).get("terminated")):
        if terminated and terminated.get("exitCode", 0) != 0:
            return terminated
    return None


def model_failure(status: dict) -> tuple[str, str] | None:
    """Why a pod cannot serve its model, from the fetch's or the engine's termination message:
    the fetch's last line is `<reason>: <details>` (unauthorized, not found, no space, model does
    not fit...); the engine says `model does not fit: ...` when tensorParallelSize cannot split it."""
    for container in status.get("initContainerStatuses") or []:
        terminated = _failed(container) if container.get("name") == FETCH_CONTAINER else None
        if terminated:
            line = _last_line(terminated.get("message") or "").removeprefix("kaon fetch: ")
            line = line or f"kaon fetch exited with code {terminated.get('exitCode')}"
            return ("ModelDoesNotFit" if line.startswith(DOES_NOT_FIT) else "ModelFetchFailed"), line
    for container in status.get("containerStatuses") or []:
        message = (_failed(container) or {}).get("message") or ""
        if f"{DOES_NOT_FIT}:" in message:
            return "ModelDoesNotFit", DOES_NOT_FIT + message.split(f"{DOES_NOT_FIT}", 1)[1].splitlines()[0]
    return None


def _time(stamp: str | None) -> datetime | None:
    try:
        return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None
    except ValueError:
        return None


# Exit codes of a container killed by a signal: SIGKILL (the kubelet after the grace period) and SIGTERM.
KILLED_EXIT_CODES = (137, 143)


def _stuck(container: dict, pod_ready: bool = False, never_ready: bool = False) -> tuple[str, str] | None:
    """(reason, message) for a container that will not run on its own: OOMKilled when its last run was
    killed for memory; StartupTimeout when it was killed before it was ever ready (the kubelet does
    that when the startup probe's budget runs out); Unhealthy when it was killed after it had served
    (a failed liveness probe: a hung or stalled engine); else the kubelet's waiting reason with the
    last run's exit code and termination message (the engine's one-line cause)."""
    name, state = container.get("name"), container.get("state") or {}
    waiting = state.get("waiting") or {}
    last = state.get("terminated") or (container.get("lastState") or {}).get("terminated") or {}
    restarts = container.get("restartCount", 0)
    # Between back-offs a crashing container runs again for a while: until it is ready, its last
    # failure still stands (else Degraded would flap, an Event per restart).
    retrying = ("running" in state and not (container.get("ready") or pod_ready)
                and last.get("exitCode", 0) != 0)
    if last.get("reason") == "OOMKilled" and (waiting or state.get("terminated") or retrying):
        return "OOMKilled", (f"container {name} was killed for using more memory than its limit "
                             f"(exit code {last.get('exitCode', 137)}, {restarts} restart(s))")
    if last.get("exitCode") in KILLED_EXIT_CODES and (waiting or retrying):
        code, cause = last["exitCode"], _last_line(last.get("message") or "")
        signal_name = "SIGKILL" if code == 137 else "SIGTERM"
        if never_ready:
            return "StartupTimeout", (f"container {name} was killed ({signal_name}) before it ever became ready "
                                      f"({restarts} restart(s)): the model takes longer to load than the startup "
                                      "probe allows (spec.engine.startupTimeoutSeconds)"
                                      + (f"; last log line: {cause}" if cause else ""))
        return "Unhealthy", (f"container {name} was killed ({signal_name}) and restarted ({restarts} restart(s)): "
                             "its liveness probe failed, the engine hung or stalled with requests pending "
                             "(spec.engine.stallTimeoutSeconds); the pod's Unhealthy Events say more"
                             + (f"; last log line: {cause}" if cause else ""))
    if waiting.get("reason") not in STUCK_REASONS and not retrying:
        return None
    if retrying:
        waiting = {"reason": "CrashLoopBackOff", "message": "restarted after a failure, not ready yet"}
    message = f"container {name}: {waiting.get('message') or waiting['reason']}"
    if last and last.get("exitCode", 0) != 0:
        cause = _last_line(last.get("message") or "")
        message = (f"container {name} exited with code {last.get('exitCode')} ({restarts} restart(s))"
                   + (f": {cause}" if cause else ""))
    return waiting["reason"], message


# How much later than the pod's start a runtime may write its first Ready=False and still mean "since the start".
NEVER_READY_SLACK_S = 5


def _probe_budget(probe: dict | None, default_failures: int = 3) -> float:
    if not probe:
        return 0.0
    return probe.get("initialDelaySeconds", 0) + probe.get("periodSeconds", 10) * probe.get("failureThreshold",
                                                                                            default_failures)


def _startup_budget(pod: dict) -> float | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    engine = next((c for c in containers if c.get("name") == "engine"), containers[0] if containers else None)
    if not engine or not (engine.get("startupProbe") or engine.get("readinessProbe")):
        return None
    return _probe_budget(engine.get("startupProbe")) + _probe_budget(engine.get("readinessProbe"))


def summarize_pod(pod: dict) -> PodSummary:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "no node fits the pod"
    ready = conditions.get("Ready", {})
    # Not ready since it started (the Ready condition has not changed since): it never served.
    became = _time(ready.get("lastTransitionTime"))
    started = _time(status.get("startTime"))
    never_ready = ready.get("status") != "True" and (became is None or started is None
                                                      or became <= started + timedelta(seconds=NEVER_READY_SLACK_S))
    stuck = next(filter(None, (_stuck(c, ready.get("status") == "True", never_ready)
                               for c in status.get("containerStatuses") or [])), None)
    not_ready_since = None
    if status.get("phase") == "Running" and ready.get("status") != "True":
        not_ready_since = (_time(ready.get("lastTransitionTime")) if ready.get("status") == "False" else None) \
            or _time(status.get("startTime"))
    return PodSummary(name=meta.get("name", ""), ip=status.get("podIP"), ready=ready.get("status") == "True",
                      terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, stuck=stuck,
                      model_failure=model_failure(status), not_ready_since=not_ready_since,
                      startup_budget_s=_startup_budget(pod))


def summarize_deployment(deployment: dict) -> DeploymentSummary:
    status = deployment.get("status") or {}
    deadline = any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                   for c in status.get("conditions") or [])
    failure = next((c for c in status.get("conditions") or []
                    if c.get("type") == "ReplicaFailure" and c.get("status") == "True"), None)
    return DeploymentSummary(
        generation=deployment.get("metadata", {}).get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=(deployment.get("spec") or {}).get("replicas", 1), total=status.get("replicas", 0),
        updated=status.get("updatedReplicas", 0), ready=status.get("readyReplicas", 0),
        available=status.get("availableReplicas", 0), progress_deadline_exceeded=deadline,
        replica_failure=None if failure is None else (failure.get("message") or failure.get("reason") or "FailedCreate"))


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _overdue(pod: PodSummary, now: datetime | None) -> float | None:
    """Seconds a pod has been not ready past what its probes allow, or None."""
    if now is None or pod.ready or pod.not_ready_since is None or pod.startup_budget_s is None:
        return None
    waited = (now - pod.not_ready_since).total_seconds()
    return waited if waited > pod.startup_budget_s else None


def _degraded(deployment: DeploymentSummary | None, pods: list[PodSummary], gpus_per_pod: int,
              now: datetime | None = None) -> dict:
    live = [p for p in pods if not p.terminating]
    pending = [p for p in live if p.unschedulable]
    if pending:
        # More pods than desired: a Surge rollout's extra pod, which needs GPUs beyond the replicas' own.
        surge = deployment is not None and deployment.total > deployment.replicas
        return _condition("Degraded", True, "Unschedulable",
                          f"{len(pending)} pod(s) need {gpus_per_pod} nvidia.com/gpu each and cannot be placed: "
                          f"{pending[0].unschedulable}" + (ROLLOUT_NEEDS_SPARE_GPUS if surge else ""))
    failing = [p for p in live if p.model_failure]
    if failing:  # before CrashLoopBackOff: the same crash loop, but with the reason
        reason, message = failing[0].model_failure
        return _condition("Degraded", True, reason,
                          f"{len(failing)} pod(s) cannot serve the model; {failing[0].name}: {message}")
    stuck = [p for p in live if p.stuck]
    if stuck:
        reason, message = stuck[0].stuck
        return _condition("Degraded", True, reason, f"{len(stuck)} pod(s) failing; {stuck[0].name}: {message}")
    if deployment and deployment.replica_failure:
        return _condition("Degraded", True, "FailedCreate",
                          f"the ReplicaSet cannot create pods: {deployment.replica_failure}")
    overdue = [(p, w) for p in live if (w := _overdue(p, now)) is not None]
    if overdue:
        pod = overdue[0][0]  # the message stays the same while it lasts: one write, one Event
        since = pod.not_ready_since.isoformat().replace("+00:00", "Z")
        return _condition("Degraded", True, "StartupTimeout",
                          f"{len(overdue)} pod(s) not ready after the {pod.startup_budget_s:.0f} s their probes allow "
                          f"(model too slow to load, or the engine never answers /ready); {pod.name}: not ready "
                          f"since {since}")
    if deployment and deployment.progress_deadline_exceeded:
        return _condition("Degraded", True, "ProgressDeadlineExceeded",
                          "the rollout made no progress within its deadline")
    return _condition("Degraded", False, "AsExpected", "")


def _ready(pods: list[PodSummary], desired: int) -> dict:
    """Ready means the service answers: one ready replica is enough (Progressing says the rest)."""
    if desired == 0:
        return _condition("Ready", False, "ScaledToZero", "0 replicas requested")
    ready = sum(p.ready and not p.terminating for p in pods)
    message = f"{ready}/{desired} replicas ready"
    if ready >= desired:
        return _condition("Ready", True, "AllReplicasReady", message)
    if ready > 0:
        return _condition("Ready", True, "PartiallyReady", message)
    return _condition("Ready", False, "ReplicasNotReady", message)


def _progressing(deployment: DeploymentSummary | None, generation_applied: bool, desired: int) -> dict:
    if deployment is None or not generation_applied:
        return _condition("Progressing", True, "Reconciling", "applying the spec to the Deployment")
    d = deployment
    if d.observed_generation < d.generation:
        return _condition("Progressing", True, "Reconciling", "the Deployment controller has not seen the change yet")
    if d.total > d.updated:  # pods of the previous template are still serving
        return _condition("Progressing", True, "RollingOut",
                          f"{d.updated}/{desired} replicas updated, {d.total - d.updated} old still running")
    if d.updated < desired:
        return _condition("Progressing", True, "ScalingUp", f"{d.updated}/{desired} replicas created")
    if d.available < desired:
        return _condition("Progressing", True, "ReplicasStarting", f"{d.available}/{desired} replicas available")
    if d.total > desired:
        return _condition("Progressing", True, "ScalingDown", f"{d.total} replicas, {desired} wanted")
    return _condition("Progressing", False, "RolloutComplete", f"{desired} replicas up to date")


def conditions(*, deployment: DeploymentSummary | None, pods: list[PodSummary], desired: int,
               gpus_per_pod: int, generation_applied: bool, now: datetime | None = None) -> list[dict]:
    """Ready, Progressing and Degraded (without timestamps) for the current state; `now` judges
    pods that stay not ready past their probes' budget (StartupTimeout)."""
    return [_ready(pods, desired), _progressing(deployment, generation_applied, desired),
            _degraded(deployment, pods, gpus_per_pod, now)]


def next_startup_deadline(pods: list[PodSummary]) -> datetime | None:
    """When the first not-ready pod runs out of its probes' budget: the status must be judged again then."""
    deadlines = [p.not_ready_since + timedelta(seconds=p.startup_budget_s) for p in pods
                 if not p.ready and not p.terminating and p.not_ready_since and p.startup_budget_s is not None]
    return min(deadlines, default=None)


def invalid_spec_conditions(message: str) -> list[dict]:
    return [_condition("Ready", False, "InvalidSpec", message),
            _condition("Progressing", False, "InvalidSpec", message),
            _condition("Degraded", True, "InvalidSpec", message)]


def apply_failed_conditions(message: str) -> list[dict]:
    return [_condition("Ready", False, "ApplyFailed", message),
            _condition("Progressing", True, "Reconciling", "retrying"),
            _condition("Degraded", True, "ApplyFailed", message)]


def stamp(new: list[dict], old: list[dict], now: datetime, generation: int) -> list[dict]:
    """Carry lastTransitionTime over when a condition's status did not change."""
    before = {c["type"]: c for c in old}
    out = []
    for cond in new:
        prev = before.get(cond["type"])
        changed = prev is None or prev.get("status") != cond["status"]
        when = now.isoformat().replace("+00:00", "Z") if changed else prev.get("lastTransitionTime")
        out.append({**cond, "lastTransitionTime": when, "observedGeneration": generation})
    return out


def transition_events(new: list[dict], old: list[dict]) -> list[EventSpec]:
    """The Events an admin wants when a condition changes: became ready, degraded, recovered,
    a rollout finished."""
    before = {c["type"]: c for c in old}
    events = []
    for cond in new:
        prev = before.get(cond["type"], {})
        flipped = prev.get("status") != cond["status"]
        new_reason = prev.get("reason") != cond["reason"]
        if cond["type"] == "Ready" and cond["status"] == "True" and flipped:
            events.append(EventSpec("Normal", "Ready", cond["message"]))
        elif cond["type"] == "Ready" and cond["status"] == "False" and prev.get("status") == "True":
            events.append(EventSpec("Warning", "NotReady", f"{cond['reason']}: {cond['message']}"))
        elif cond["type"] == "Degraded" and cond["status"] == "True" and (flipped or new_reason):
            events.append(EventSpec("Warning", cond["reason"], cond["message"]))
        elif cond["type"] == "Degraded" and cond["status"] == "False" and prev.get("status") == "True":
            events.append(EventSpec("Normal", "Recovered", f"no longer degraded ({prev.get('reason')})"))
        elif cond["type"] == "Progressing" and cond["reason"] == "RolloutComplete" and prev.get("reason") == "RollingOut":
            events.append(EventSpec("Normal", "RolloutComplete", cond["message"]))
        elif cond["type"] == DISRUPTION and cond["reason"] == BLOCKED and (flipped or new_reason):
            events.append(EventSpec("Warning", "DisruptionBlocked", cond["message"]))
        elif cond["type"] == DISRUPTION and cond["status"] == "True" and prev.get("reason") == BLOCKED:
            events.append(EventSpec("Normal", "DisruptionAllowed", cond["message"]))
        elif cond["type"] == "MetricsAvailable" and cond["status"] == "False" and flipped:
            events.append(EventSpec("Warning", "MetricsUnavailable", cond["message"]))
        elif cond["type"] == "MetricsAvailable" and cond["status"] == "True" and prev.get("status") == "False":
            events.append(EventSpec("Normal", "MetricsAvailable", cond["message"]))
        elif cond["type"] == NAME_CONFLICT and cond["status"] == "True" and (flipped or new_reason):
            events.append(EventSpec("Warning", NAME_CONFLICT, cond["message"]))
    new_types = {c["type"] for c in new}
    for prev in old:  # NameConflict is listed only while it holds
        if prev.get("type") == NAME_CONFLICT and prev.get("status") == "True" and NAME_CONFLICT not in new_types:
            events.append(EventSpec("Normal", "NameConflictResolved", "this InferenceService answers its served "
                                    "name again"))
    return events


# Served-name conflicts ----------------------------------------------------------------------------------


NAME_CONFLICT = "NameConflict"


class ServedName(NamedTuple):
    """What naming.conflicts needs of an InferenceService."""

    key: tuple[str, str]
    served_name: str
    created: int


def served_name(body: dict) -> ServedName:
    meta = body["metadata"]
    created = meta.get("creationTimestamp")
    epoch = int(datetime.fromisoformat(created.replace("Z", "+00:00")).timestamp()) if created else 0
    return ServedName((meta["namespace"], meta["name"]),
                      ((body.get("spec") or {}).get("model") or {}).get("servedName") or meta["name"], epoch)


def name_conflicts(peers: list[ServedName]) -> dict[tuple[str, str], dict]:
    """The NameConflict condition of each InferenceService of one namespace that another, older one
    shadows (the router sends its served name there: naming.py). The others have none."""
    return {key: _condition(NAME_CONFLICT, True, "ServedNameTaken",
                            f"served name `{winner.served_name}` is already answered by the older InferenceService "
                            f"{winner.key[1]} of this namespace; this one gets no traffic until that one is gone or "
                            "one of them sets another spec.model.servedName")
            for key, winner in naming.conflicts(peers).items()}


def replica_counts(pods: list[PodSummary]) -> dict:
    live = [p for p in pods if not p.terminating]
    return {"replicas": len(live), "readyReplicas": sum(p.ready for p in live)}


# Voluntary disruptions ----------------------------------------------------------------------------------------------
#
# What a PodDisruptionBudget blocks: evictions (`kubectl drain`, the cluster autoscaler's scale-down,
# anything using the Eviction API), which the apiserver refuses with 429. It does NOT block the
# Deployment controller: scale-downs and rolling updates delete pods directly. The apiserver records
# no Event for a refused eviction, so what the operator can say comes from the PDB's status: with the
# default unhealthyPodEvictionPolicy (IfHealthyBudget), a healthy pod may be evicted only while
# disruptionsAllowed > 0, an unhealthy one only while currentHealthy >= desiredHealthy.

DISRUPTION = "DisruptionAllowed"
BLOCKED = "InsufficientHealthyReplicas"


@dataclass(frozen=True, slots=True)
class PdbSummary:
    disruptions_allowed: int
    current_healthy: int
    desired_healthy: int
    expected_pods: int
    observed: bool
    """The disruption controller has computed the status for the PDB's current spec."""


def summarize_pdb(pdb: dict) -> PdbSummary:
    st = pdb.get("status") or {}
    return PdbSummary(disruptions_allowed=st.get("disruptionsAllowed", 0), current_healthy=st.get("currentHealthy", 0),
                      desired_healthy=st.get("desiredHealthy", 0), expected_pods=st.get("expectedPods", 0),
                      observed=st.get("observedGeneration", 0) >= (pdb.get("metadata") or {}).get("generation", 0))


def disruption_condition(pdb: PdbSummary | None, pods: list[PodSummary], now: datetime | None = None) -> dict | None:
    """DisruptionAllowed: False when the PDB refuses evictions. While replicas are merely starting (a
    scale-up, a rollout) that is expected and said quietly (ReplicasStarting); when they are failing
    or overdue it is InsufficientHealthyReplicas, which posts a Warning."""
    if pdb is None or not pdb.observed or pdb.expected_pods == 0:
        return None
    refuses_healthy = pdb.disruptions_allowed == 0 and pdb.current_healthy > 0
    refuses_all = pdb.current_healthy < pdb.desired_healthy
    if not (refuses_healthy or refuses_all):
        return _condition(DISRUPTION, True, "SufficientHealthyReplicas",
                          f"{pdb.disruptions_allowed} replica(s) may be evicted (node drains proceed)")
    which = "evictions of every engine pod" if refuses_all else "evictions of ready engine pods"
    message = (f"{which} are refused (kubectl drain and the cluster autoscaler wait): the PodDisruptionBudget keeps "
               f"{pdb.desired_healthy} of {pdb.expected_pods} replicas healthy and {pdb.current_healthy} are; "
               "Deployment scale-downs and rollouts delete pods directly and are not blocked")
    live = [p for p in pods if not p.terminating and not p.ready]
    starting = live and all(not (p.stuck or p.model_failure or p.unschedulable) and _overdue(p, now) is None
                            for p in live)
    return _condition(DISRUPTION, False, "ReplicasStarting" if starting else BLOCKED, message)
