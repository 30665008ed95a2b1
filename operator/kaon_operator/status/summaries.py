"""What the cluster shows, read from its objects' dicts into small frozen records.

kopf's indexes keep these summaries (not whole pods) for the status policy (conditions.py) and
the autoscaler; every Kubernetes field name the operator reads about pods, Deployments,
PodDisruptionBudgets and served names is read here.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from kaon_operator import api, kubetime
from kaon_operator.children.pod_template import ENGINE_CONTAINER, FETCH_CONTAINER

# Container waiting reasons that mean the pod will not become ready on its own.
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "InvalidImageName",
                 "CreateContainerConfigError", "CreateContainerError", "RunContainerError")


@dataclass(frozen=True, slots=True)
class PodSummary:
    name: str
    ip: str | None = None
    ready: bool = False
    terminating: bool = False
    containers_ready: bool = False
    """Its containers pass their probes: the engine answers, though a readiness gate may hold the pod."""
    gates_pending: frozenset[str] = frozenset()
    """Its readiness gates (spec.readinessGates) whose pod condition is not True yet."""
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
    asleep: bool = False
    """A standby replica put to sleep by the operator (its kaon.dev/asleep condition): not ready on purpose."""
    created: str = ""
    """metadata.creationTimestamp (RFC 3339, comparable as text): the standby loop puts the newest to sleep."""


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


DOES_NOT_FIT = "model does not fit"  # how `kaon fetch` and `kaon serve` begin that reason
# How `kaon serve` begins a flag its model cannot take (a sentence encoder's --enable-runtime-lora, --role, ...).
UNSUPPORTED = "unsupported by the model"
# The engine's own start refusals, by the words its termination message begins the cause with.
ENGINE_REFUSALS = ((DOES_NOT_FIT, "ModelDoesNotFit"), (UNSUPPORTED, "UnsupportedByModel"))


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
    not fit...); the engine says `model does not fit: ...` when tensorParallelSize cannot split it, and
    `unsupported by the model: ...` for a flag its model cannot take (a sentence encoder's LoRA or role)."""
    for container in status.get("initContainerStatuses") or []:
        terminated = _failed(container) if container.get("name") == FETCH_CONTAINER else None
        if terminated:
            line = _last_line(terminated.get("message") or "").removeprefix("kaon fetch: ")
            line = line or f"kaon fetch exited with code {terminated.get('exitCode')}"
            return ("ModelDoesNotFit" if line.startswith(DOES_NOT_FIT) else "ModelFetchFailed"), line
    for container in status.get("containerStatuses") or []:
        message = (_failed(container) or {}).get("message") or ""
        for words, reason in ENGINE_REFUSALS:
            if f"{words}:" in message:
                return reason, words + message.split(words, 1)[1].splitlines()[0]
    return None


def _time(stamp: str | None) -> datetime | None:
    try:
        return kubetime.parse(stamp)
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


def _startup_budget(pod: Mapping[str, Any]) -> float | None:
    containers = (pod.get("spec") or {}).get("containers") or []
    engine = next((c for c in containers if c.get("name") == ENGINE_CONTAINER), containers[0] if containers else None)
    if not engine or not (engine.get("startupProbe") or engine.get("readinessProbe")):
        return None
    return _probe_budget(engine.get("startupProbe")) + _probe_budget(engine.get("readinessProbe"))


def summarize_pod(pod: Mapping[str, Any]) -> PodSummary:
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
    gate_types = {g.get("conditionType") for g in (pod.get("spec") or {}).get("readinessGates") or ()}
    return PodSummary(name=meta.get("name", ""), ip=status.get("podIP"), ready=ready.get("status") == "True",
                      containers_ready=conditions.get("ContainersReady", {}).get("status") == "True",
                      gates_pending=frozenset(t for t in gate_types if conditions.get(t, {}).get("status") != "True"),
                      terminating=bool(meta.get("deletionTimestamp")), unschedulable=unschedulable, stuck=stuck,
                      model_failure=model_failure(status), not_ready_since=not_ready_since,
                      startup_budget_s=_startup_budget(pod),
                      asleep=conditions.get("kaon.dev/asleep", {}).get("status") == "True",
                      created=meta.get("creationTimestamp") or "")


def summarize_deployment(deployment: Mapping[str, Any]) -> DeploymentSummary:
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
        replica_failure=None if failure is None
        else (failure.get("message") or failure.get("reason") or "FailedCreate"))


@dataclass(frozen=True, slots=True)
class PdbSummary:
    disruptions_allowed: int
    current_healthy: int
    desired_healthy: int
    expected_pods: int
    observed: bool
    """The disruption controller has computed the status for the PDB's current spec."""


def summarize_pdb(pdb: Mapping[str, Any]) -> PdbSummary:
    st = pdb.get("status") or {}
    return PdbSummary(disruptions_allowed=st.get("disruptionsAllowed", 0), current_healthy=st.get("currentHealthy", 0),
                      desired_healthy=st.get("desiredHealthy", 0), expected_pods=st.get("expectedPods", 0),
                      observed=st.get("observedGeneration", 0) >= (pdb.get("metadata") or {}).get("generation", 0))



class ServedName(NamedTuple):
    """What naming.conflicts needs of an InferenceService."""

    key: api.Key
    served_name: str
    created: int


def served_name(body: Mapping[str, Any]) -> ServedName:
    """Read from the raw body (valid spec or not): every InferenceService of a namespace holds its name."""
    meta = body["metadata"]
    return ServedName(api.Key(meta["namespace"], meta["name"]),
                      api.served_name((body.get("spec") or {}).get("model"), meta["name"]),
                      int(kubetime.epoch(meta.get("creationTimestamp")) or 0))
