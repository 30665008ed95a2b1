"""Pure policy: an InferenceService's status conditions and the Events their changes deserve.

Every condition dict the operator writes is built here (Ready, Progressing, Degraded,
DisruptionAllowed, NameConflict, MetricsAvailable, Profiled, AdaptersReady, ResourceConflict), from the
summaries of what the cluster shows (summaries.py) and what the loops found. No I/O, so every rule is
testable in microseconds.

Over 300 lines for a stated reason: every condition the operator writes, the loops' three included, is
built in this one place, beside the Events its changes post.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from kaon_operator import api, kubetime, naming
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.autoscaling.profiling import JOB_TTL_SECONDS, Step
from kaon_operator.status import prefill_status
from kaon_operator.status.summaries import DeploymentSummary, PdbSummary, PodSummary, ServedName

READY, PROGRESSING, DEGRADED = "Ready", "Progressing", "Degraded"
METRICS = "MetricsAvailable"
PROFILED = "Profiled"
ADAPTERS_READY = "AdaptersReady"
NAME_CONFLICT = "NameConflict"
RESOURCE_CONFLICT = "ResourceConflict"
DISRUPTION = "DisruptionAllowed"
BLOCKED = "InsufficientHealthyReplicas"
LWS_MISSING = "LeaderWorkerSetMissing"  # a multi-node spec where the LeaderWorkerSet API is not installed


@dataclass(frozen=True, slots=True)
class EventSpec:
    type: str  # Normal or Warning
    reason: str
    message: str


ROLLOUT_NEEDS_SPARE_GPUS = ("; the rollout (spec.rollout.strategy Surge) starts each new pod before stopping an old "
                            "one and waits for spare GPUs: Replace rolls out on the GPUs the old pods free")


def _condition(type_: str, ok: bool | None, reason: str, message: str) -> dict:
    """One condition; `ok` None: Unknown."""
    status = "Unknown" if ok is None else "True" if ok else "False"
    return {"type": type_, "status": status, "reason": reason, "message": message}


def _overdue(pod: PodSummary, now: datetime | None) -> float | None:
    """Seconds a pod has been not ready past what its probes allow, or None."""
    if now is None or pod.ready or pod.asleep or pod.not_ready_since is None or pod.startup_budget_s is None:
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
        return _condition(DEGRADED, True, "Unschedulable",
                          f"{len(pending)} pod(s) need {gpus_per_pod} nvidia.com/gpu each and cannot be placed: "
                          f"{pending[0].unschedulable}" + (ROLLOUT_NEEDS_SPARE_GPUS if surge else ""))
    failing = [(p.name, p.model_failure) for p in live if p.model_failure]
    if failing:  # before CrashLoopBackOff: the same crash loop, but with the reason
        name, (reason, message) = failing[0]
        return _condition(DEGRADED, True, reason, f"{len(failing)} pod(s) cannot serve the model; {name}: {message}")
    stuck = [(p.name, p.stuck) for p in live if p.stuck]
    if stuck:
        name, (reason, message) = stuck[0]
        return _condition(DEGRADED, True, reason, f"{len(stuck)} pod(s) failing; {name}: {message}")
    if deployment and deployment.replica_failure:
        return _condition(DEGRADED, True, "FailedCreate",
                          f"the ReplicaSet cannot create pods: {deployment.replica_failure}")
    overdue = [(p, p.not_ready_since) for p in live if _overdue(p, now) is not None and p.not_ready_since]
    if overdue:
        pod, since = overdue[0]  # the message stays the same while it lasts: one write, one Event
        return _condition(DEGRADED, True, "StartupTimeout",
                          f"{len(overdue)} pod(s) not ready after the {pod.startup_budget_s:.0f} s their probes allow "
                          f"(model too slow to load, or the engine never answers /ready); {pod.name}: not ready "
                          f"since {kubetime.stamp(since)}")
    if deployment and deployment.progress_deadline_exceeded:
        return _condition(DEGRADED, True, "ProgressDeadlineExceeded",
                          "the rollout made no progress within its deadline")
    return _condition(DEGRADED, False, "AsExpected", "")


def _ready(pods: list[PodSummary], desired: int) -> dict:
    """Ready means the service answers: one ready replica is enough (Progressing says the rest)."""
    if desired == 0:
        return _condition(READY, False, "ScaledToZero", "0 replicas requested")
    ready = sum(p.ready and not p.terminating for p in pods)
    message = f"{ready}/{desired} replicas ready"
    if ready >= desired:
        return _condition(READY, True, "AllReplicasReady", message)
    if ready > 0:
        return _condition(READY, True, "PartiallyReady", message)
    return _condition(READY, False, "ReplicasNotReady", message)


def _progressing(deployment: DeploymentSummary | None, generation_applied: bool, desired: int) -> dict:
    if deployment is None or not generation_applied:
        return _condition(PROGRESSING, True, "Reconciling", "applying the spec to the Deployment")
    d = deployment
    if d.observed_generation < d.generation:
        return _condition(PROGRESSING, True, "Reconciling", "the Deployment controller has not seen the change yet")
    if d.total > d.updated:  # pods of the previous template are still serving
        return _condition(PROGRESSING, True, "RollingOut",
                          f"{d.updated}/{desired} replicas updated, {d.total - d.updated} old still running")
    if d.updated < desired:
        return _condition(PROGRESSING, True, "ScalingUp", f"{d.updated}/{desired} replicas created")
    if d.available < desired:
        return _condition(PROGRESSING, True, "ReplicasStarting", f"{d.available}/{desired} replicas available")
    if d.total > max(desired, d.replicas):  # the Deployment's own count has the standbys too
        return _condition(PROGRESSING, True, "ScalingDown", f"{d.total} replicas, {desired} wanted")
    return _condition(PROGRESSING, False, "RolloutComplete", f"{desired} replicas up to date")


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
    return [_condition(READY, False, "InvalidSpec", message),
            _condition(PROGRESSING, False, "InvalidSpec", message),
            _condition(DEGRADED, True, "InvalidSpec", message)]


def apply_failed_conditions(message: str) -> list[dict]:
    return [_condition(READY, False, "ApplyFailed", message),
            _condition(PROGRESSING, True, "Reconciling", "retrying"),
            _condition(DEGRADED, True, "ApplyFailed", message)]



def missing_api_conditions(reason: str, message: str) -> list[dict]:
    """The spec needs an API the cluster does not serve (the LeaderWorkerSet's): nothing is applied."""
    return [_condition(READY, False, reason, message),
            _condition(PROGRESSING, False, reason, message),
            _condition(DEGRADED, True, reason, message)]


def resource_conflict_conditions(message: str) -> list[dict]:
    """A child's name is taken by an object the service does not control: nothing is applied over it."""
    return [_condition(READY, False, RESOURCE_CONFLICT, message),
            _condition(PROGRESSING, False, RESOURCE_CONFLICT, message),
            _condition(DEGRADED, True, RESOURCE_CONFLICT, message),
            _condition(RESOURCE_CONFLICT, True, "NotOwned", message)]


def metrics_condition(metrics_missing: str | None, answered: int, ready: int) -> dict:
    """MetricsAvailable, kept by the autoscaler: whether the ready replicas answered its scrape."""
    if metrics_missing:
        return _condition(METRICS, False, "ScrapeFailed", f"{metrics_missing}; no scale-down until they answer")
    return _condition(METRICS, True, "Scraped", f"{answered} of {ready} ready replicas answered")


def profiled_condition(step: Step, name: str, why: str = "") -> dict:
    """Profiled: True with a model to read, Unknown while the Job measures, False when it failed."""
    if step in (Step.USE, Step.SAVE):
        return _condition(PROFILED, True, PROFILED, f"the performance model is in ConfigMap {name}")
    if step is Step.FAILED:
        return _condition(PROFILED, False, "ProfilingFailed",
                          f"profiling Job {name} failed: {why}; the reactive policy scales meanwhile; deleting the "
                          f"Job tries again (it is retried {JOB_TTL_SECONDS // 60} minutes after it ended)")
    return _condition(PROFILED, None, "Profiling",
                      f"profiling Job {name} measures the engine; the reactive policy scales meanwhile")


def named_profile_condition(name: str, model: PerfModel | None) -> dict:
    """Profiled for a ConfigMap the user names."""
    if model is not None:
        return _condition(PROFILED, True, "ProfileConfigMap", f"the performance model is in ConfigMap {name}")
    return _condition(PROFILED, False, "ProfileUnreadable",
                      f"ConfigMap {name} has no readable performance model under key {api.PROFILE_KEY}; "
                      "the reactive policy scales meanwhile")


def adapters_condition(want: Mapping[str, str], pods: Mapping[str, Mapping[str, str]],
                       failures: Mapping[str, str]) -> dict | None:
    """AdaptersReady: True when every ready pod holds every adapter; False naming the adapters that
    failed (or are still loading); Unknown while no ready pod answers (not "loaded on 0 pods": a
    `kubectl wait` for it right after creation must not pass before any pod has loaded one). None
    without adapters."""
    if not want:
        return None
    if not pods and not failures:
        return _condition(ADAPTERS_READY, None, "NoReadyPods",
                          "no ready pod answered: the adapters are loaded on each pod once it is ready")
    if failures:
        names = ", ".join(f"{n}: {failures[n]}" for n in sorted(failures))
        return _condition(ADAPTERS_READY, False, "AdapterLoadFailed",
                          f"adapters that could not be loaded (the base model keeps serving): {names}")
    missing = sorted(n for n, path in want.items() if any(have.get(n) != path for have in pods.values()))
    if missing:
        return _condition(ADAPTERS_READY, False, "Loading", f"not yet loaded on every ready pod: {', '.join(missing)}")
    return _condition(ADAPTERS_READY, True, "Loaded", f"{len(want)} adapter(s) loaded on {len(pods)} ready pod(s)")


def name_conflicts(peers: list[ServedName]) -> dict[api.Key, dict]:
    """The NameConflict condition of each InferenceService of one namespace that another, older one
    shadows (the router sends its served name there: naming.py). The others have none."""
    return {key: _condition(NAME_CONFLICT, True, "ServedNameTaken",
                            f"served name `{winner.served_name}` is already answered by the older InferenceService "
                            f"{winner.key[1]} of this namespace; this one gets no traffic until that one is gone or "
                            "one of them sets another spec.model.servedName")
            for key, winner in naming.conflicts(peers).items()}


def replica_counts(pods: list[PodSummary], groups: DeploymentSummary | None = None) -> dict:
    """Pods, or with multi-node replicas the LeaderWorkerSet's groups (ready: every pod of the group is)."""
    if groups is not None:
        return {"replicas": groups.total, "readyReplicas": groups.ready}
    live = [p for p in pods if not p.terminating]
    return {"replicas": len(live), "readyReplicas": sum(p.ready for p in live),
            "standbyReplicas": sum(p.asleep for p in live)}


# Voluntary disruptions ----------------------------------------------------------------------------------------------
#
# What a PodDisruptionBudget blocks: evictions (`kubectl drain`, the cluster autoscaler's scale-down,
# anything using the Eviction API), which the apiserver refuses with 429. It does NOT block the
# Deployment controller: scale-downs and rolling updates delete pods directly. The apiserver records
# no Event for a refused eviction, so what the operator can say comes from the PDB's status: with the
# default unhealthyPodEvictionPolicy (IfHealthyBudget), a healthy pod may be evicted only while
# disruptionsAllowed > 0, an unhealthy one only while currentHealthy >= desiredHealthy.


def disruption_condition(pdb: PdbSummary | None, pods: list[PodSummary], now: datetime | None = None,
                         desired: int | None = None) -> dict | None:
    """DisruptionAllowed: False when the PDB refuses evictions. While replicas are merely starting (a
    scale-up, a rollout) that is expected and said quietly (ReplicasStarting); when they are failing
    or overdue it is InsufficientHealthyReplicas, which posts a Warning. `desired` (spec.replicas): a
    scale-up from one replica raises minAvailable from 0 to 1 before the Deployment has created the new
    pods, so every pod there is ready and yet the PDB refuses: starting too, not an incident."""
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
    if not live and desired is not None:  # all ready, but fewer than wanted: pods not created yet
        starting = sum(not p.terminating for p in pods) < desired
    return _condition(DISRUPTION, False, "ReplicasStarting" if starting else BLOCKED, message)


def stamp(new: list[dict], old: list[dict], now: datetime, generation: int) -> list[dict]:
    """Carry lastTransitionTime over when a condition's status did not change."""
    before = {c["type"]: c for c in old}
    out = []
    for cond in new:
        prev = before.get(cond["type"])
        unchanged = prev is not None and prev.get("status") == cond["status"]
        when = prev.get("lastTransitionTime") if prev is not None and unchanged else kubetime.stamp(now)
        out.append({**cond, "lastTransitionTime": when, "observedGeneration": generation})
    return out


# Transitions: per condition type, the Event (if any) for its change from `prev` to `new` --------------------------


def _flipped(new: dict, prev: dict) -> bool:
    return prev.get("status") != new["status"]


def _newly(new: dict, prev: dict) -> bool:
    """The condition now holds for a reason it did not hold for before."""
    return _flipped(new, prev) or prev.get("reason") != new["reason"]


def _ready_event(new: dict, prev: dict) -> EventSpec | None:
    if new["status"] == "True" and _flipped(new, prev):
        return EventSpec("Normal", "Ready", new["message"])
    if new["status"] == "False" and prev.get("status") == "True":
        return EventSpec("Warning", "NotReady", f"{new['reason']}: {new['message']}")
    return None


def _degraded_event(new: dict, prev: dict) -> EventSpec | None:
    if new["status"] == "True" and _newly(new, prev):
        return EventSpec("Warning", new["reason"], new["message"])
    if new["status"] == "False" and prev.get("status") == "True":
        return EventSpec("Normal", "Recovered", f"no longer degraded ({prev.get('reason')})")
    return None


def _progressing_event(new: dict, prev: dict) -> EventSpec | None:
    if new["reason"] == "RolloutComplete" and prev.get("reason") == "RollingOut":
        return EventSpec("Normal", "RolloutComplete", new["message"])
    return None


def _disruption_event(new: dict, prev: dict) -> EventSpec | None:
    if new["reason"] == BLOCKED and _newly(new, prev):
        return EventSpec("Warning", "DisruptionBlocked", new["message"])
    if new["status"] == "True" and prev.get("reason") == BLOCKED:
        return EventSpec("Normal", "DisruptionAllowed", new["message"])
    return None


def _metrics_event(new: dict, prev: dict) -> EventSpec | None:
    if new["status"] == "False" and _flipped(new, prev):
        return EventSpec("Warning", "MetricsUnavailable", new["message"])
    if new["status"] == "True" and prev.get("status") == "False":
        return EventSpec("Normal", "MetricsAvailable", new["message"])
    return None


def _name_conflict_event(new: dict, prev: dict) -> EventSpec | None:
    if new["status"] == "True" and _newly(new, prev):
        return EventSpec("Warning", NAME_CONFLICT, new["message"])
    return None


TRANSITIONS: dict[str, Callable[[dict, dict], EventSpec | None]] = {
    READY: _ready_event, DEGRADED: _degraded_event, PROGRESSING: _progressing_event,
    DISRUPTION: _disruption_event, METRICS: _metrics_event, NAME_CONFLICT: _name_conflict_event,
    prefill_status.PREFILL_READY: lambda new, prev: EventSpec(*e) if (e := prefill_status.event(new, prev)) else None}


def transition_events(new: list[dict], old: list[dict]) -> list[EventSpec]:
    """The Events an admin wants when a condition changes: became ready, degraded, recovered,
    a rollout finished, drains blocked, metrics lost, a served name taken (and freed)."""
    before = {c["type"]: c for c in old}
    events = [event for cond in new if cond["type"] in TRANSITIONS
              if (event := TRANSITIONS[cond["type"]](cond, before.get(cond["type"], {}))) is not None]
    new_types = {c["type"] for c in new}
    for prev in old:  # NameConflict is listed only while it holds
        if prev.get("type") == NAME_CONFLICT and prev.get("status") == "True" and NAME_CONFLICT not in new_types:
            events.append(EventSpec("Normal", "NameConflictResolved", "this InferenceService answers its served "
                                    "name again"))
    return events
