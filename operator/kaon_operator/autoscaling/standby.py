"""spec.autoscaling.standby: replicas kept scheduled, loaded and asleep, so a scale-up wakes one (seconds)
instead of starting a pod (a cold start: minutes on a GPU). Pure decisions; standby_sync.py does the I/O.

The Deployment runs spec.replicas + standby pods; the engines run with --enable-sleep-mode and the
service's admin key. Every round the standby loop asks each loaded pod whether it sleeps (vLLM's
GET /is_sleeping) and then:

- fewer awake pods than spec.replicas (a scale-up): it wakes sleeping ones (POST /wake_up), which
  turn Ready in a second or two; the Deployment, grown by the same step, starts a pod behind them,
  which loads and which the loop puts to sleep: the new standby.
- more awake pods than spec.replicas (pods that just loaded, or a scale-down): it puts the newest
  awake ones to sleep (POST /sleep?level=1; the engine first waits for its requests in flight). On
  a scale-down the ReplicaSet removes a pod that is not Ready first, so a sleeping one goes and the
  awake one that had too many is put to sleep in its place: no awake pod is cut.

A sleeping pod carries the pod condition `kaon.dev/asleep` (True), which the status reads
(status.standbyReplicas, the STANDBY column) and which keeps it out of the autoscaler's count of
starting pods and out of the StartupTimeout check (a standby is not ready on purpose).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, replace

from kaon_operator import api
from kaon_operator.autoscaling.autoscaler import Decision

ASLEEP_CONDITION = "kaon.dev/asleep"
SLEEP_LEVEL = 1
"""Level 1: the KV pool freed (on a GPU the weights wait in host memory, so a wake is a copy back)."""


def standby_count(spec: api.InferenceServiceSpec) -> int:
    return spec.autoscaling.standby if spec.autoscaling.enabled else 0


def deployment_replicas(spec: api.InferenceServiceSpec) -> int:
    """The pods the Deployment runs: the replicas that serve, and the standbys behind them."""
    return spec.replicas + standby_count(spec)


def from_zero(decision: Decision, spec: api.AutoscalingSpec, current: int) -> Decision:
    """From zero, a scale-up wakes every standby at once rather than one: they are loaded and paid for
    already, the first requests of a burst wait for whatever serves them, and the policy sizes the
    replicas down again after its stabilization window."""
    wanted = min(spec.standby if spec.enabled else 0, spec.max_replicas)
    if current or not decision.replicas or decision.replicas >= wanted:
        return decision
    return replace(decision, replicas=wanted, reason=f"{decision.reason}; from zero: all {wanted} standbys woken")


STANDBY_READINESS_PERIOD_SECONDS = 1
"""A woken standby serves from its next readiness probe, and one put to sleep leaves the router's set after
the probe's failures: with the default 5 s period those add up to 5 s to a wake of a second and keep a sleeping
pod Ready for up to 10 s. A GET /ready a second is cheap."""


def readiness_period(spec: api.InferenceServiceSpec, default: int) -> int:
    return min(default, STANDBY_READINESS_PERIOD_SECONDS) if standby_count(spec) else default


def engine_args(spec: api.InferenceServiceSpec) -> list[str]:
    return ["--enable-sleep-mode"] if standby_count(spec) else []


def asleep_condition(asleep: bool) -> dict:
    """The pod condition the loop sets when it puts a pod to sleep (True) or wakes it (False)."""
    return {"type": ASLEEP_CONDITION, "status": "True" if asleep else "False",
            "reason": "Standby" if asleep else "Awake",
            "message": "asleep (sleep mode): a standby replica" if asleep else "awake: serving"}


@dataclass(frozen=True, slots=True)
class Loaded:
    """A pod whose engine answered /is_sleeping: loaded, asleep or not."""

    name: str
    asleep: bool
    started: str = ""
    """When the pod started (RFC 3339, comparable as text): the newest are put to sleep first."""


@dataclass(frozen=True, slots=True)
class Plan:
    wake: list[str] = field(default_factory=list)
    sleep: list[str] = field(default_factory=list)


def summary(done: Plan, awake_before: int, serving: int) -> list[tuple[str, str]]:
    """(reason, message) of the Normal Events a round's done work deserves."""
    out = []
    if done.wake:
        out.append(("StandbyWoken", f"woke {len(done.wake)} standby replica(s) ({', '.join(done.wake)}) for "
                    f"{serving} serving replicas ({awake_before} awake); new standbys start behind them"))
    if done.sleep:
        out.append(("StandbyAsleep", f"put {len(done.sleep)} replica(s) to sleep as standby "
                    f"({', '.join(done.sleep)}): {awake_before} awake for {serving} serving replicas"))
    return out


def plan(pods: list[Loaded], serving: int) -> Plan:
    """What to wake or put to sleep so that `serving` (spec.replicas) loaded pods are awake.

    Pods still loading do not answer and are not in `pods`: they come up awake, and the next round
    puts them to sleep if they are one too many."""
    awake = sorted((p for p in pods if not p.asleep), key=lambda p: (p.started, p.name))
    asleep = sorted((p for p in pods if p.asleep), key=lambda p: (p.started, p.name))
    if len(awake) < serving:
        return Plan(wake=[p.name for p in asleep[:serving - len(awake)]])
    if len(awake) > serving:
        return Plan(sleep=[p.name for p in awake[serving:]][::-1])  # the newest first
    return Plan()


MAX_REASON_CHARS = 300  # an Event's message stays readable (and under the apiserver's 1 KiB note limit)


def engine_refusal(status: int, body: str) -> str:
    """Why an engine refused a wake or a sleep, from its answer: the OpenAI error's message where it sent one
    (e.g. "sleep is not supported with tensor or pipeline parallelism ..."), else the body as it came."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.strip() or "no body"
    return f"{status}: {str(message)[:MAX_REASON_CHARS]}"


def failure_message(refused: dict[str, str]) -> str:
    """The StandbyFailed Event's message: each pod the round could not wake or put to sleep, with its engine's
    reason, so `kubectl describe` says why standbys stay awake (a setting the engine cannot sleep with)."""
    return "; ".join(f"could not wake or put to sleep {pod}: {why}" for pod, why in refused.items()) + \
        "; the next round tries again"
