"""Pure functions from what the cluster shows to an InferenceService's status and Events.

The handlers feed in summaries of the Deployment and its pods (taken from watch caches)
and the conditions last written; out come the new status and the Events an admin should
see for each condition that changed. No I/O here, so every rule is testable in microseconds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime

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


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(slots=True)
class StatusUpdate:
    status: dict
    events: list[EventSpec] = field(default_factory=list)


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


def summarize_pod(pod: dict) -> PodSummary:
    meta, status = pod.get("metadata", {}), pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled", {})
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "no node fits the pod"
    stuck = None
    for container in status.get("containerStatuses") or []:
        waiting = (container.get("state") or {}).get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            stuck = (waiting["reason"], f"container {container.get('name')}: {waiting.get('message') or waiting['reason']}")
            break
    return PodSummary(name=meta.get("name", ""), ip=status.get("podIP"), ready=conditions.get("Ready", {}).get("status") == "True",
                      terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, stuck=stuck,
                      model_failure=model_failure(status))


def summarize_deployment(deployment: dict) -> DeploymentSummary:
    status = deployment.get("status") or {}
    deadline = any(c.get("type") == "Progressing" and c.get("reason") == "ProgressDeadlineExceeded"
                   for c in status.get("conditions") or [])
    return DeploymentSummary(
        generation=deployment.get("metadata", {}).get("generation", 0),
        observed_generation=status.get("observedGeneration", 0),
        replicas=(deployment.get("spec") or {}).get("replicas", 1), total=status.get("replicas", 0),
        updated=status.get("updatedReplicas", 0), ready=status.get("readyReplicas", 0),
        available=status.get("availableReplicas", 0), progress_deadline_exceeded=deadline)


def _condition(type_: str, ok: bool, reason: str, message: str) -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message}


def _degraded(deployment: DeploymentSummary | None, pods: list[PodSummary], gpus_per_pod: int) -> dict:
    live = [p for p in pods if not p.terminating]
    pending = [p for p in live if p.unschedulable]
    if pending:
        return _condition("Degraded", True, "Unschedulable",
                          f"{len(pending)} pod(s) need {gpus_per_pod} nvidia.com/gpu each and cannot be placed: "
                          f"{pending[0].unschedulable}")
    failing = [p for p in live if p.model_failure]
    if failing:  # before CrashLoopBackOff: the same crash loop, but with the reason
        reason, message = failing[0].model_failure
        return _condition("Degraded", True, reason,
                          f"{len(failing)} pod(s) cannot serve the model; {failing[0].name}: {message}")
    stuck = [p for p in live if p.stuck]
    if stuck:
        reason, message = stuck[0].stuck
        return _condition("Degraded", True, reason, f"{len(stuck)} pod(s) failing; {stuck[0].name}: {message}")
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
               gpus_per_pod: int, generation_applied: bool) -> list[dict]:
    """Ready, Progressing and Degraded (without timestamps) for the current state."""
    return [_ready(pods, desired), _progressing(deployment, generation_applied, desired),
            _degraded(deployment, pods, gpus_per_pod)]


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
        elif cond["type"] == "MetricsAvailable" and cond["status"] == "False" and flipped:
            events.append(EventSpec("Warning", "MetricsUnavailable", cond["message"]))
        elif cond["type"] == "MetricsAvailable" and cond["status"] == "True" and prev.get("status") == "False":
            events.append(EventSpec("Normal", "MetricsAvailable", cond["message"]))
    return events


def replica_counts(pods: list[PodSummary]) -> dict:
    live = [p for p in pods if not p.terminating]
    return {"replicas": len(live), "readyReplicas": sum(p.ready for p in live)}
