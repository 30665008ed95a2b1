"""What the observed latencies teach the performance model: its bias, learned online.

The model (perf_model.py) has the engine's shape; the service's own scale comes from the
P99 it observes. A stretch of steady replicas (`judged`) pairs the latencies measured with
the P99 the model predicts for that stretch's load; the bias is the multiplier at which 99%
of their requests met the prediction (`multiplier`), over the newest BIAS_REQUESTS requests
for the policy's present (`bias`), and over the stretches at a load as heavy or heavier for
a scale-down (`at_load`), since the model's error grows with the load.

Pure functions, no I/O.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import autoscaler, histogram
from kaon_operator.autoscaling.autoscaler import Sample
from kaon_operator.autoscaling.demand import latency, load
from kaon_operator.autoscaling.perf_model import PerfModel

BIAS_BOUNDS = (0.5, 2.0)
BIAS_REQUESTS = 1000  # the newest requests the bias is learned from
SETTLE_SECONDS = 60.0  # after replicas change, latencies still belong to the load from before
MAX_UTILIZATION = 0.9  # past this, latency is a cliff the model cannot place precisely


@dataclass(frozen=True, slots=True)
class Judged:
    """A stretch of steady replicas: its latencies, the model's P99 and utilization for its load."""

    latencies: histogram.Buckets
    predicted: float
    utilization: float

    @property
    def requests(self) -> float:
        return self.latencies[-1][1] if self.latencies else 0.0


def judged(history: list[Sample], model: PerfModel, spec: AutoscalingSpec) -> list[Judged]:
    """The history's stretches, newest first: the same ready replicas, none starting (latencies
    measured across a change belong to the load from before), no queue over target (a backlog
    is a transient the steady-state model does not describe), each of at least
    MIN_LATENCY_REQUESTS requests; none without a latency target."""
    if not spec.target_p99_latency_seconds:
        return []
    out: list[Judged] = []
    stretch: list[Sample] = []
    merged: histogram.Buckets = ()
    for sample, settled in reversed(list(zip(history, _settled(history)))):
        queued = sample.ready and sample.waiting / sample.ready > spec.target_queue_depth_per_replica
        if not settled or not sample.ready or not sample.complete or queued or \
                (stretch and sample.ready != stretch[0].ready):
            stretch, merged = [], ()
            continue
        stretch.append(sample)
        merged = histogram.add_buckets(merged, sample.latency)
        if (merged[-1][1] if merged else 0.0) < autoscaler.MIN_LATENCY_REQUESTS:
            continue
        demand = load(stretch[::-1])
        if demand is not None and demand.rate > 0:
            p = model.predict(demand.rate / sample.ready, demand.prompt, demand.output)
            predicted = latency(model, spec, p, demand.output)
            if 0 < predicted < math.inf:
                out.append(Judged(merged, predicted, p.utilization))
        stretch, merged = [], ()
    return out


def _settled(history: list[Sample]) -> list[bool]:
    """Per sample: SETTLE_SECONDS or more since replicas last started or changed. Latencies
    are counted when requests finish, so for a while after a change (a burst, a scale-up)
    they are the backlog's from before it; learnt as the bias, they held 8 replicas for
    an hour after a 2-minute burst."""
    out, changed, previous = [], -math.inf, None
    for sample in history:
        if sample.starting or (previous is not None and sample.ready != previous):
            changed = sample.time
        previous = sample.ready
        out.append(sample.time - changed >= SETTLE_SECONDS)
    return out


def multiplier(stretches: list[Judged]) -> float:
    """The multiplier m at which 99% of the stretches' requests came in within m x the
    model's P99, bounded to BIAS_BOUNDS; 1 without any. Pooled, since the P99 of one
    stretch of 100 is its slowest."""
    total = sum(j.requests for j in stretches)
    if not total:
        return 1.0

    def share_over(m: float) -> float:
        return sum(histogram.count_above(j.latencies, m * j.predicted) for j in stretches) / total

    low, high = BIAS_BOUNDS
    if share_over(high) > 0.01:
        return high
    if share_over(low) <= 0.01:
        return low
    for _ in range(20):  # bisection: the share over m x predicted falls as m grows
        mid = (low + high) / 2
        low, high = (mid, high) if share_over(mid) > 0.01 else (low, mid)
    return high


def wilson(over: float, n: float, sign: float) -> float:
    """Wilson's bound (sign -1: lower, +1: upper) on a share from `over` of `n`, at CONFIDENCE_Z."""
    z2, share = autoscaler.CONFIDENCE_Z ** 2, over / n
    spread = autoscaler.CONFIDENCE_Z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n))
    return (share + z2 / (2 * n) + sign * spread) / (1 + z2 / n)


def confident(stretches: list[Judged]) -> float:
    """The bias the stretches prove: 1 (the model as measured) unless 99% confidence puts the
    multiplier above 1 (then the lowest it can be) or below 1 (the highest). The point
    estimate over a few hundred requests is their few slowest ones and wanders with them;
    a bias that follows it makes a steady load at a replica boundary move both ways."""
    total = sum(j.requests for j in stretches)
    if not total:
        return 1.0

    def share_bound(m: float, sign: float) -> float:
        return wilson(sum(histogram.count_above(j.latencies, m * j.predicted) for j in stretches), total, sign)

    low, high = BIAS_BOUNDS
    if share_bound(1.0, -1) > 0.01:  # more than 1% over the model, confidently: the least bias that explains it
        lo, hi = 1.0, high
        if share_bound(hi, -1) > 0.01:
            return high
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share_bound(mid, -1) > 0.01 else (lo, mid)
        return hi
    if share_bound(1.0, +1) < 0.01:  # confidently under 1% over: the most the bias can be below 1
        lo, hi = low, 1.0
        if share_bound(lo, +1) < 0.01:
            return low
        for _ in range(20):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if share_bound(mid, +1) >= 0.01 else (lo, mid)
        return hi
    return 1.0


def newest(stretches: list[Judged]) -> list[Judged]:
    """The newest stretches up to BIAS_REQUESTS requests: what the online bias is learned from."""
    out, total = [], 0.0
    for j in stretches:
        if total >= BIAS_REQUESTS:
            break
        out.append(j)
        total += j.requests
    return out


def bias(history: list[Sample], model: PerfModel, spec: AutoscalingSpec) -> float:
    """The model's bias now: the multiplier of the newest stretches."""
    return multiplier(newest(judged(history, model, spec)))


def at_load(stretches: list[Judged], utilization: float, current: float) -> float:
    """The bias for a load of `utilization` per replica: the larger of the current one and
    that of the stretches measured at that utilization or more. The model's error grows
    with the load (queueing), so a bias learned on a lighter load is not carried to a
    heavier one where the history has seen the heavier one: a scale-down then goes only
    where the model held before, not into the count the last scale-up left."""
    heavier = [j for j in stretches if j.utilization >= utilization]
    return max(current, multiplier(heavier)) if heavier else current


def utilization_ceiling(history: list[Sample], model: PerfModel, spec: AutoscalingSpec) -> float:
    """The lowest predicted utilization per replica at which the latency target was
    confidently missed in the history (MAX_UTILIZATION without a miss): where the model,
    bias and all, proved wrong, a scale-down must not load the replicas again, or the next
    scale-up only brings the count back (the predictive twin of autoscaler.latency_ceiling,
    in utilization so that it carries over a changed length mix). Judged as there: stretches
    of MIN_LATENCY_REQUESTS requests, cut newest first, at the same ready replicas, none starting;
    and, as the bias is (judged), on settled samples only: in the first SETTLE_SECONDS after a
    change the latencies are the backlog's from before it, and the stretch's rate, averaged over
    minutes after, is not the load that missed. Learnt from those, a burst's end left a ceiling at
    a third of the utilization the model allows, which held 6 replicas through the next burst
    where 4 did (bench/history/autoscale_sim.md, "idle-burst's cost")."""
    goal = spec.target_p99_latency_seconds
    if not goal:
        return MAX_UTILIZATION
    ceiling = MAX_UTILIZATION
    for stretch in autoscaler.missed_stretches(history, goal, _settled(history)):
        demand = load(stretch[::-1])
        if demand is not None and demand.rate > 0:
            ceiling = min(ceiling, model.predict(demand.rate / stretch[0].ready, demand.prompt,
                                                 demand.output).utilization)
    return ceiling
