"""The autoscaling policy: (history, spec, current replicas, now) -> (desired replicas, reason).

A pure function, so every trace (a step, a burst, a ramp, noise, idleness) is a unit test.

- Load is a ratio to target: waiting requests per ready replica over
  `targetQueueDepthPerReplica`, or P99 latency over `targetP99LatencySeconds`, whichever is
  higher. Above 1 the service is overloaded.
- Scale up when the ratio stayed above 1 for `scaleUpWindowSeconds`, to
  ceil(current x ratio), at most `maxStep` more. A burst (ratio >= PANIC_RATIO in the latest
  sample) skips the window: it reacts within one tick, like Knative's panic mode.
- Scale down when the ratio stayed below 1 - TOLERANCE for `scaleDownStabilizationSeconds`
  since both the window start and the last change, at most `maxStep` fewer.
- With minReplicas 0: to zero after `scaleToZeroIdleSeconds` without a single request, and
  back to one as soon as the router holds a request for the service.
- Never below minReplicas nor above maxReplicas.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kaon_operator.api import AutoscalingSpec

PANIC_RATIO = 2.0
TOLERANCE = 0.1  # a ratio within 10% under target is "at target": no scale-down churn


@dataclass(frozen=True, slots=True)
class Sample:
    """What one scrape of all ready engine pods showed."""

    time: float
    ready: int
    queue_depth: float
    """Waiting requests, summed over the ready pods."""
    running: float = 0.0
    p99_seconds: float | None = None
    """P99 of the spec's latency metric over the requests since the previous sample."""
    requests_total: float = 0.0
    """Finished requests so far, summed over pods (only its changes matter)."""
    held_by_router: float = 0.0
    """Requests the router holds because no pod is ready (scale from zero)."""


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str


def load_ratio(sample: Sample, spec: AutoscalingSpec) -> tuple[float, str]:
    """The load relative to target (1.0 = at target) and the figure that sets it."""
    per_replica = sample.queue_depth / max(sample.ready, 1)
    ratio = per_replica / spec.target_queue_depth_per_replica
    why = f"queue depth {per_replica:.1f} per replica"
    target = f"target {spec.target_queue_depth_per_replica:g}"
    if spec.target_p99_latency_seconds and sample.p99_seconds is not None:
        latency_ratio = sample.p99_seconds / spec.target_p99_latency_seconds
        if latency_ratio > ratio:
            ratio = latency_ratio
            why = f"P99 {spec.latency_metric} {sample.p99_seconds:.2f}s"
            target = f"target {spec.target_p99_latency_seconds:g}s"
    return ratio, f"{why} {'>' if ratio > 1 else '<='} {target}"


def _window(history: list[Sample], now: float, seconds: float) -> list[Sample] | None:
    """The samples of the last `seconds`, or None when the history does not reach back that far."""
    if not history or history[0].time > now - seconds:
        return None
    return [s for s in history if s.time >= now - seconds] or [history[-1]]


def _idle_for(history: list[Sample], now: float, seconds: float) -> bool:
    window = _window(history, now, seconds)
    if window is None:
        return False
    before = [s for s in history if s.time <= now - seconds][-1]
    return all(s.queue_depth == 0 and s.running == 0 and s.held_by_router == 0
               and s.requests_total == before.requests_total for s in window)


def _clamp(desired: int, spec: AutoscalingSpec, current: int) -> int:
    step_bounded = max(current - spec.max_step, min(current + spec.max_step, desired))
    return max(spec.min_replicas, min(spec.max_replicas, step_bounded))


def decide(history: list[Sample], spec: AutoscalingSpec, current: int, now: float,
           last_change: float | None = None) -> Decision:
    """`history` is oldest first; `last_change` is when replicas last changed (survives restarts
    through the InferenceService's status)."""
    if current < spec.min_replicas or current > spec.max_replicas:
        bounded = max(spec.min_replicas, min(spec.max_replicas, current))
        return Decision(bounded, f"{current} replicas is outside {spec.min_replicas}..{spec.max_replicas}")
    if not history:
        return Decision(current, "no metrics yet")
    latest = history[-1]
    if current == 0:
        if latest.held_by_router > 0:
            return Decision(max(1, spec.min_replicas), f"{latest.held_by_router:g} requests waiting at the router")
        return Decision(0, "idle")

    ratio, why = load_ratio(latest, spec)
    if ratio >= PANIC_RATIO:
        return Decision(_clamp(math.ceil(current * ratio), spec, current), f"{why} (burst)")
    up = _window(history, now, spec.scale_up_window_seconds)
    if up is not None and all(load_ratio(s, spec)[0] > 1 for s in up):
        lowest = min(load_ratio(s, spec)[0] for s in up)
        return Decision(_clamp(math.ceil(current * lowest), spec, current), why)

    if spec.min_replicas == 0 and spec.scale_to_zero_idle_seconds and \
            _idle_for(history, now, spec.scale_to_zero_idle_seconds):
        return Decision(0, f"no requests for {spec.scale_to_zero_idle_seconds}s")
    stable_since = now - spec.scale_down_stabilization_seconds
    down = _window(history, now, spec.scale_down_stabilization_seconds)
    if down is not None and (last_change is None or last_change <= stable_since):
        highest, why_highest = max(load_ratio(s, spec) for s in down)
        if highest < 1 - TOLERANCE:
            desired = max(1, _clamp(math.ceil(current * highest), spec, current))
            if desired < current:
                return Decision(desired, f"{why_highest} for {spec.scale_down_stabilization_seconds}s")
    return Decision(current, why)
