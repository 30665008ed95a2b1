"""The predictive policy: size replicas from the load and a measured model of the engine.

`spec.autoscaling.policy: predictive`. Where the reactive policy (autoscaler.py) waits for
concurrency, a queue or a missed P99 to say capacity is short, this one computes it: from
the history of scrapes it reads the arrival rate and the mean prompt and output lengths
(the engines' request and token counters), and from the performance model (perf_model.py,
measured by a profile of the engine) the fewest replicas whose predicted P99 latency stays
MARGIN under `targetP99LatencySeconds` (without a target: whose utilization stays under
`targetUtilization`) and whose KV cache holds the running sequences. So a longer prompt mix
at a constant request rate scales up before the P99 is missed.

- **Bias**: the model's P99 is multiplied by the factor at which 99% of the newest
  BIAS_REQUESTS requests (in stretches of steady replicas) met it, bounded to BIAS_BOUNDS:
  the model's shape, the service's own scale.
- **Up**: at once when the rate of the last `scaleUpWindowSeconds` (its lower bound,
  UP_SIGMAS Poisson deviations down), carried a cold start ahead along the part of a rise
  over the window before that exceeds RISE_SIGMAS deviations, with the length mix of at
  least MIX_REQUESTS requests, needs more replicas. The reactive policy's
  evidence (a queue over the whole window, a confident P99 miss) still adds replicas when
  the model is wrong.
- **Down**: only when the rate of the last `scaleDownStabilizationSeconds` (its upper
  bound, DOWN_SIGMAS deviations up) and every stretch of `scaleUpWindowSeconds` in it (their lower bounds) fit fewer
  replicas, with no queue and the observed P99 under target in that window (as the
  reactive policy).
- **Fail safe** exactly as the reactive policy: bounds, zero and missing metrics are judged
  by the same code (autoscaler.guard); with a scrape missing, only a scale-up goes ahead.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kaon_operator import autoscaler, scraper
from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaler import TOLERANCE, Decision, Sample
from kaon_operator.perf_model import OUTPUT_TAIL, PerfModel, Prediction

MARGIN = 0.05  # the predicted P99 sits this far under the target: the model is an estimate
MAX_UTILIZATION = 0.9  # past this, latency is a cliff the model cannot place precisely
BIAS_BOUNDS = (0.5, 2.0)
BIAS_REQUESTS = 1000  # the newest requests the bias is learned from
MIX_REQUESTS = 120  # the mean prompt and output lengths rest on at least these (5% noise on uniform lengths)
RISE_SIGMAS = 3.0  # a rate rise counts as a trend past this many Poisson standard deviations
UP_SIGMAS = 2.5  # scale up for the rate's lower bound over a scale-up window: Poisson noise moves nothing
DOWN_SIGMAS = 1.0  # scale down for the upper bound over the stabilization window (longer: less noise)


@dataclass(frozen=True, slots=True)
class Load:
    rate: float
    """Requests arriving per second."""
    prompt: float
    output: float
    """Mean prompt and output tokens per request."""
    requests: float
    """Requests the estimate rests on."""
    seconds: float = 0.0

    def bound(self, sigmas: float) -> Load:
        """The load with its rate moved `sigmas` Poisson standard deviations (negative: down)."""
        spread = sigmas * math.sqrt(max(self.requests, 1.0)) / self.seconds if self.seconds else 0.0
        return Load(max(0.0, self.rate + spread), self.prompt, self.output, self.requests, self.seconds)


def load(samples: list[Sample]) -> Load | None:
    """The load over consecutive samples: arrivals = finished + the change in concurrency;
    mean lengths = tokens over arrivals (prompt tokens are counted as requests are accepted,
    and in a steady state tokens are generated at the arrival rate x the mean output).
    None with fewer than two samples."""
    if len(samples) < 2:
        return None
    span = samples[-1].time - samples[0].time
    seconds = span * len(samples) / (len(samples) - 1)  # the first sample's own interval too
    finished = sum(s.finished for s in samples)
    arrived = max(0.0, finished + samples[-1].estimated_concurrency - samples[0].estimated_concurrency)
    prompt = sum(s.prompt_tokens for s in samples) / arrived if arrived else 0.0
    output = sum(s.output_tokens for s in samples) / arrived if arrived else 0.0
    return Load(arrived / seconds if seconds > 0 else 0.0, prompt, max(1.0, output), arrived, seconds)


def latency(model: PerfModel, spec: AutoscalingSpec, prediction: Prediction, output: float) -> float:
    """The predicted P99 of the spec's latency metric."""
    if spec.latency_metric == "e2e":
        return prediction.ttft_p99 + OUTPUT_TAIL * output * prediction.itl
    return prediction.ttft_p99


def fits(model: PerfModel, spec: AutoscalingSpec, demand: Load, replicas: int, bias: float) -> bool:
    p = model.predict(demand.rate / replicas, demand.prompt, demand.output)
    if p.utilization > MAX_UTILIZATION or p.batch > model.max_num_seqs:
        return False
    if model.kv_cache_tokens is not None and p.kv_tokens > model.kv_cache_tokens:
        return False
    goal = spec.target_p99_latency_seconds
    if goal is None:
        return p.utilization <= spec.target_utilization
    return bias * latency(model, spec, p, demand.output) <= goal * (1 - MARGIN)


def needed(model: PerfModel, spec: AutoscalingSpec, demand: Load, bias: float) -> int:
    """The fewest replicas that fit `demand` (maxReplicas + 1 when none up to there does)."""
    if demand.rate <= 0:
        return 1
    return next((n for n in range(1, spec.max_replicas + 1) if fits(model, spec, demand, n, bias)),
                spec.max_replicas + 1)


def bias(history: list[Sample], model: PerfModel, spec: AutoscalingSpec) -> float:
    """The multiplier m at which 99% of the newest requests came in within m x the model's
    P99 for their stretch: stretches of the same ready replicas, none starting and no queue
    over target (latencies measured across a change belong to the load from before; a
    backlog is a transient the steady-state model does not describe), each of at least
    MIN_LATENCY_REQUESTS requests, pooled newest first up to BIAS_REQUESTS; bounded to
    BIAS_BOUNDS; 1 without any. Pooled, since the P99 of one stretch of 100 is its slowest."""
    if not spec.target_p99_latency_seconds:
        return 1.0
    judged: list[tuple[scraper.Buckets, float]] = []  # (a stretch's latencies, its predicted P99)
    stretch: list[Sample] = []
    total = 0.0
    for sample in reversed(history):
        if total >= BIAS_REQUESTS:
            break
        queued = sample.ready and sample.waiting / sample.ready > spec.target_queue_depth_per_replica
        if sample.starting or not sample.ready or not sample.complete or queued or \
                (stretch and sample.ready != stretch[0].ready):
            stretch = []
            continue
        stretch.append(sample)
        merged = scraper.add_buckets(*(s.latency for s in stretch))
        count = merged[-1][1] if merged else 0.0
        if count < autoscaler.MIN_LATENCY_REQUESTS:
            continue
        demand = load(stretch[::-1])
        if demand is not None and demand.rate > 0:
            p = model.predict(demand.rate / sample.ready, demand.prompt, demand.output)
            predicted = latency(model, spec, p, demand.output)
            if 0 < predicted < math.inf:
                judged.append((merged, predicted))
                total += count
        stretch = []
    if not judged:
        return 1.0

    def share_over(m: float) -> float:
        return sum(scraper.count_above(b, m * predicted) for b, predicted in judged) / total

    low, high = BIAS_BOUNDS
    if share_over(high) > 0.01:
        return high
    if share_over(low) <= 0.01:
        return low
    for _ in range(20):  # bisection: the share over m x predicted falls as m grows
        mid = (low + high) / 2
        low, high = (mid, high) if share_over(mid) > 0.01 else (low, mid)
    return high


def projected(history: list[Sample], spec: AutoscalingSpec, model: PerfModel, now: float) -> Load | None:
    """The load of the last scale-up window, its rate carried a cold start ahead when it rose
    significantly over the window before."""
    seconds = spec.scale_up_window_seconds or 5
    recent = [s for s in history if s.time > now - seconds and s.mostly_answered]
    before = [s for s in history if now - 2 * seconds < s.time <= now - seconds and s.mostly_answered]
    demand = load(recent)
    if demand is None:
        return None
    mixed = recent
    for sample in reversed([s for s in history if s.time <= now - seconds and s.mostly_answered]):
        if sum(s.finished for s in mixed) >= MIX_REQUESTS or sample.time < now - spec.scale_down_stabilization_seconds:
            break
        mixed = [sample, *mixed]
    mix = load(mixed)
    assert mix is not None  # `mixed` holds `recent`, which gave `demand`
    demand = Load(demand.rate, mix.prompt, mix.output, demand.requests, demand.seconds)
    earlier = load(before)
    if earlier is not None:
        # Only the part of the rise beyond noise is carried ahead.
        rise = demand.requests - earlier.requests - RISE_SIGMAS * math.sqrt(demand.requests + earlier.requests)
        if rise > 0:
            ahead = seconds / 2 + model.cold_start_seconds  # the window's mean is half a window old
            slope = rise / demand.seconds / seconds
            return Load(demand.rate + slope * ahead, demand.prompt, demand.output, demand.requests, demand.seconds)
    return demand


def _down(history: list[Sample], spec: AutoscalingSpec, model: PerfModel, current: int, now: float,
          last_change: float | None, factor: float) -> tuple[int, str] | None:
    seconds, sub = spec.scale_down_stabilization_seconds, spec.scale_up_window_seconds or 5
    if last_change is not None and last_change > now - min(seconds, sub):
        return None
    window = [s for s in history if s.time >= now - seconds]
    if not window or history[0].time > now - seconds or not history[-1].complete:
        return None
    known = [s for s in window if s.mostly_answered and s.held_by_router is not None]
    if len(known) < autoscaler.MIN_COMPLETE_SHARE * len(window):
        return None
    if any(s.ready and s.waiting / (s.answered or s.ready) > spec.target_queue_depth_per_replica for s in known):
        return None
    p99, _ = autoscaler.window_p99(known)
    goal = spec.target_p99_latency_seconds
    if goal and p99 is not None and p99 > goal * (1 - TOLERANCE):
        return None
    whole = load(known)
    if whole is None:
        return None
    wanted = needed(model, spec, whole.bound(DOWN_SIGMAS), factor)
    for end in known:  # and no stretch of a scale-up window in it needs as many as now
        demand = load([s for s in known if end.time - sub < s.time <= end.time])
        if demand is not None:
            wanted = max(wanted, needed(model, spec, demand.bound(-UP_SIGMAS), factor))
        if wanted >= current:
            return None
    return wanted, (f"rate {whole.rate:.2f}/s over {seconds}s, no shorter stretch above it, fits {wanted} "
                    f"by the performance model (bias {factor:.2f})")


def decide(history: list[Sample], spec: AutoscalingSpec, current: int, now: float,
           last_change: float | None = None, *, model: PerfModel, max_num_seqs: int = 64) -> Decision:
    """As autoscaler.decide, with the engine's performance model."""
    target = autoscaler.concurrency_target(spec, max_num_seqs)
    early = autoscaler.guard(history, spec, current, target)
    if early is not None:
        return early
    missing = autoscaler.missing_metrics(history[-1])
    factor = bias(history, model, spec)
    wishes = []
    demand = projected(history, spec, model, now)
    if demand is not None:
        n = needed(model, spec, demand.bound(-UP_SIGMAS), factor)
        if n > current:
            wishes.append((n, f"rate {demand.rate:.2f}/s, prompts {demand.prompt:.0f} and outputs "
                              f"{demand.output:.0f} tokens need {n} by the performance model (bias {factor:.2f})"))
    evidence = autoscaler.up_wish(history, spec, math.inf, current, now, last_change)  # queue, P99 missed
    if evidence is not None:
        wishes.append(evidence)
    if wishes:
        return autoscaler.scaled_up(*max(wishes), spec, current, missing)
    if missing:
        return Decision(current, f"holding at {current}", missing)
    if autoscaler.idle(history, spec, current, now, last_change):
        return Decision(0, f"no requests for {spec.scale_to_zero_idle_seconds}s")
    down = _down(history, spec, model, current, now, last_change, factor)
    if down is not None:
        wanted, why = down
        return Decision(max(1, autoscaler.bounded(wanted, spec, current)), why)
    return Decision(current, f"the load fits {current} by the performance model (bias {factor:.2f})")
