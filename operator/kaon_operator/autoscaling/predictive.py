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
  requests met it, bounded (model_bias.py): the model's shape, the service's own scale.
  Up uses the bias the requests prove with 99% confidence (1 until they do), down the
  larger of that and the point estimate: a load between the two moves neither way.
- **Floor**: where no replica count brings the predicted P99 under the target (a long
  prompt's own prefill), the count stops where one more would gain less than MARGIN.
- **Up**: at once when the rate of the last `scaleUpWindowSeconds` (its lower bound,
  UP_SIGMAS Poisson deviations down), or of an EXTRA_WINDOWS stretch (10 and 20 s, where a
  step or a burst shows; 120 and 300 s, where a slow rise does), with the length mix of at
  least MIX_REQUESTS requests, plus the backlog in flight beyond that rate's steady state
  (beyond its noise too) cleared over a cold start, needs more replicas; then to what the
  rate itself (not its lower bound) needs, carried a cold start ahead along the part of a
  rise over the stretch before that exceeds RISE_SIGMAS deviations, so that a step is met
  in one move. A longer window proves nothing while the newest scale-up window (its upper bound)
  fits the current replicas: its rate is then a load that has ended. The reactive policy's evidence (a queue
  over the whole window, a confident P99 miss in MISS_WINDOWS stretches in a row) still
  adds replicas when the model is wrong.
- **Down**: only when the rate of the last `scaleDownStabilizationSeconds` (its upper
  bound, DOWN_SIGMAS deviations up: the same confidence as a scale-up needs, so that a rate
  near a replica boundary moves neither way) and every stretch of `scaleUpWindowSeconds` in
  it (their lower bounds) fit fewer replicas, with no queue and the observed P99 under
  target in that window (as the reactive policy). And the fewer replicas are judged with
  what the history (an hour) has seen at their load: the bias of the stretches measured at
  that utilization or more when it is larger than today's (the model's error grows with the
  load), and no load at or past one that confidently missed the target. Never while the window holds a
  scrape at zero ready replicas (a burst from idle: the idle seconds would average its rate down). Without these a
  steady load near a boundary flaps: down on the bias learned at the lighter load, up again
  when the heavier one misses.
- **Fail safe** exactly as the reactive policy: bounds, zero and missing metrics are judged
  by the same code (autoscaler.guard); with a scrape missing, only a scale-up goes ahead.
"""
from __future__ import annotations

import math

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import autoscaler, model_bias
from kaon_operator.autoscaling.autoscaler import TOLERANCE, Decision, Sample
from kaon_operator.autoscaling.demand import Load, latency, load, mean_output
from kaon_operator.autoscaling.model_bias import MAX_UTILIZATION, utilization_ceiling
from kaon_operator.autoscaling.perf_model import PerfModel

MARGIN = 0.05  # the predicted P99 sits this far under the target: the model is an estimate
MIX_REQUESTS = 120  # the mean prompt and output lengths rest on at least these (5% noise on uniform lengths)
RISE_SIGMAS = 3.0  # a rate rise counts as a trend past this many Poisson standard deviations
UP_SIGMAS = 2.5  # scale up for the rate's lower bound over a scale-up window: Poisson noise moves nothing
MISS_WINDOWS = 2  # a P99 miss overrides the model when it holds in this many stretches in a row
SHORT_SIGMAS = 3.0  # more than UP_SIGMAS: every tick tests these windows too, and few requests are in them
LONG_SIGMAS = 2.0  # less: these windows hold hundreds of requests, and a slow rise shows in them first
# (seconds, sigmas) tested beside the scale-up window: a step or a burst shows in seconds, a
# slow rise past a replica boundary only over minutes (at 2.5 deviations of 60 s a ramp
# was 40% past the boundary before it showed).
EXTRA_WINDOWS = ((10.0, SHORT_SIGMAS), (20.0, SHORT_SIGMAS), (120.0, LONG_SIGMAS), (300.0, LONG_SIGMAS))
DOWN_SIGMAS = UP_SIGMAS  # scale down for the upper bound over the stabilization window: the same confidence both ways


def fits(model: PerfModel, spec: AutoscalingSpec, demand: Load, replicas: int, bias: float,
         ceiling: float = MAX_UTILIZATION) -> bool:
    p = model.predict(demand.rate / replicas, demand.prompt, demand.output)
    if p.utilization > MAX_UTILIZATION or p.utilization >= ceiling or p.batch > model.max_num_seqs:
        return False
    if model.kv_cache_tokens is not None and p.kv_tokens > model.kv_cache_tokens:
        return False
    goal = spec.target_p99_latency_seconds
    if goal is None:
        return p.utilization <= spec.target_utilization
    return bias * latency(model, spec, p, demand.output) <= goal * (1 - MARGIN)


def needed(model: PerfModel, spec: AutoscalingSpec, demand: Load, bias: float,
           ceiling: float = MAX_UTILIZATION) -> int:
    """The fewest replicas that fit `demand` (maxReplicas + 1 when none up to there does),
    each loaded under `ceiling` (a utilization); or, where the latency left over the target
    is the floor that no replica count removes (a long prompt's own prefill), the count past
    which one more replica would cut the predicted P99 by less than MARGIN of the target:
    near the floor the count that "fits" swings from 5 to 10 with a few tokens of mean
    prompt, and buys nothing the next replica would not."""
    if demand.rate <= 0:
        return 1
    goal = spec.target_p99_latency_seconds
    previous = math.inf
    for n in range(1, spec.max_replicas + 1):
        if fits(model, spec, demand, n, bias, ceiling):
            return n
        p = model.predict(demand.rate / n, demand.prompt, demand.output)
        if goal and fits(model, spec, demand, n, bias=0.0, ceiling=ceiling):  # within every bound but latency
            predicted = bias * latency(model, spec, p, demand.output)
            if previous - predicted < MARGIN * goal:
                return n - 1
            previous = predicted
    return spec.max_replicas + 1


def arrivals(history: list[Sample], since: float, until: float) -> Load | None:
    """The load of (since, until]: the requests finished in it plus the change in concurrency
    from the scrape that opens it (the last at or before `since`) to the one that closes it.
    demand.load takes the change from its first sample, an interval short: on a window of a
    few scrapes that alone doubled a jump of concurrency into a "rate". None without a usable
    scrape at both ends."""
    usable = [s for s in history if s.time <= until and s.mostly_answered]
    opening = [s for s in usable if s.time <= since]
    if not opening or usable[-1].time <= since:
        return None
    start, end = opening[-1], usable[-1]
    inside = [s for s in history if start.time < s.time <= end.time]
    arrived = max(0.0, sum(s.finished for s in inside) + end.estimated_concurrency - start.estimated_concurrency)
    seconds = end.time - start.time
    prompt = sum(s.prompt_tokens for s in inside) / arrived if arrived else 0.0
    return Load(arrived / seconds, prompt, max(1.0, mean_output(inside, arrived)), arrived, seconds)


def window_load(history: list[Sample], spec: AutoscalingSpec, now: float, seconds: float) -> Load | None:
    """The load of the last `seconds`, with the length mix of at least MIX_REQUESTS requests.
    None when no request of the history has finished: without a length mix the model cannot
    size the load."""
    recent = [s for s in history if s.time > now - seconds and s.mostly_answered]
    demand = arrivals(history, now - seconds, now) or load(recent)
    if demand is None:
        return None
    mixed = recent
    for sample in reversed([s for s in history if s.time <= now - seconds and s.mostly_answered]):
        if sum(s.finished for s in mixed) >= MIX_REQUESTS or sample.time < now - spec.scale_down_stabilization_seconds:
            break
        mixed = [sample, *mixed]
    mix = load(mixed)
    if mix is None or not any(s.finished for s in mixed) or not any(s.prompt_tokens for s in mixed):
        # Nothing accepted or finished lately (from zero, the first requests wait at the router
        # and read as zero tokens long): the lengths the whole history knows.
        mix = load([s for s in history if s.mostly_answered])
        if mix is None or not any(s.finished for s in history):
            return None
    return Load(demand.rate, mix.prompt, mix.output, demand.requests, demand.seconds)


def carried_ahead(history: list[Sample], demand: Load, model: PerfModel, now: float, seconds: float) -> Load:
    """`demand`, the load of the last `seconds`, its rate carried a cold start ahead along the
    part of its rise over the stretch before that is beyond noise."""
    earlier = arrivals(history, now - 2 * seconds, now - seconds)
    if earlier is None:
        return demand
    rise = demand.requests - earlier.requests - RISE_SIGMAS * math.sqrt(demand.requests + earlier.requests)
    if rise <= 0:
        return demand
    ahead = seconds / 2 + model.cold_start_seconds  # the window's mean is half a window old
    slope = rise / demand.seconds / seconds
    return Load(demand.rate + slope * ahead, demand.prompt, demand.output, demand.requests, demand.seconds)


def with_backlog(demand: Load, latest: Sample, model: PerfModel, current: int, sigmas: float = 0.0) -> Load:
    """The load plus the backlog to clear: requests in flight beyond what the rate keeps in
    flight in a steady state (Little's law, at the model's P99 TTFT: a backlog is never
    overstated), less `sigmas` of that count's own Poisson spread, cleared over a cold start,
    the time new replicas take to come. After a step or a burst the steady state of the new
    rate is not enough: what queued while replicas started still has to be served. (Without
    the spread, a steady load's in-flight count, 50 +- 7, read as a backlog one tick in three
    and moved a replica boundary's count both ways every ten minutes.)"""
    p = model.predict(demand.rate / max(current, 1), demand.prompt, demand.output)
    steady_in_flight = demand.rate * (p.ttft_p99 + demand.output * p.itl)
    backlog = latest.estimated_concurrency - steady_in_flight - sigmas * math.sqrt(max(steady_in_flight, 0.0))
    if not math.isfinite(backlog) or backlog <= 0:
        return demand
    drain = max(model.cold_start_seconds, autoscaler.HISTORY_MARGIN_SECONDS)
    return Load(demand.rate + backlog / drain, demand.prompt, demand.output, demand.requests, demand.seconds)


def _down(history: list[Sample], spec: AutoscalingSpec, model: PerfModel, current: int, now: float,
          last_change: float | None, stretches: list[model_bias.Judged], factor: float) -> tuple[int, str] | None:
    seconds, sub = spec.scale_down_stabilization_seconds, spec.scale_up_window_seconds or 5
    if last_change is not None and last_change > now - min(seconds, sub):
        return None
    window = [s for s in history if s.time >= now - seconds]
    if not window or history[0].time > now - seconds or not history[-1].complete:
        return None
    if any(not s.ready for s in window):
        # Part of the window was spent at zero (a burst from idle): its rate averages the idle
        # seconds in. It read a burst 15 s old as a tenth of itself (3 replicas -> 1, then up again).
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
    upper, ceiling = whole.bound(DOWN_SIGMAS), utilization_ceiling(history, model, spec)
    wanted = needed(model, spec, upper, factor, ceiling)
    while wanted < current:  # with the bias the history shows at the fewer replicas' load or heavier
        load_there = model.predict(whole.rate / wanted, whole.prompt, whole.output).utilization
        if fits(model, spec, upper, wanted, model_bias.at_load(stretches, load_there, factor), ceiling):
            break
        wanted += 1
    for end in known:  # and no stretch of a scale-up window in it needs as many as now
        demand = load([s for s in known if end.time - sub < s.time <= end.time])
        if demand is not None:
            wanted = max(wanted, needed(model, spec, demand.bound(-UP_SIGMAS), factor))
        if wanted >= current:
            return None
    return wanted, (f"rate {whole.rate:.2f}/s over {seconds}s, no shorter stretch above it, fits {wanted} "
                    f"by the performance model (bias {factor:.2f})")


def _newest_fits(history: list[Sample], spec: AutoscalingSpec, model: PerfModel, current: int, now: float,
                 factor: float) -> bool:
    """Whether the newest scale-up window's rate, at its upper bound (UP_SIGMAS deviations up) with its
    backlog, fits the current replicas. Then a longer window's rate is the past, not a slow rise: after a
    burst ended, the 300 s window still read 0.9 requests/s while none came, and scaled 1 -> 3 and back
    again every 20 s for two minutes."""
    newest = window_load(history, spec, now, spec.scale_up_window_seconds or 5)
    if newest is None:
        return False
    return needed(model, spec, with_backlog(newest, history[-1], model, current).bound(UP_SIGMAS), factor) <= current


def decide(history: list[Sample], spec: AutoscalingSpec, current: int, now: float,
           last_change: float | None = None, *, model: PerfModel, max_num_seqs: int = 64) -> Decision:
    """As autoscaler.decide, with the engine's performance model."""
    target = autoscaler.concurrency_target(spec, max_num_seqs)
    early = autoscaler.guard(history, spec, current, target)
    if early is not None:
        return early
    missing = autoscaler.missing_metrics(history[-1])
    stretches = model_bias.judged(history, model, spec)
    newest = model_bias.newest(stretches)
    factor = model_bias.confident(newest)
    wishes, sized = [], False
    newest_fits = _newest_fits(history, spec, model, current, now, factor)
    for seconds, sigmas in ((spec.scale_up_window_seconds or 5, UP_SIGMAS), *EXTRA_WINDOWS):
        observed = window_load(history, spec, now, seconds)
        if observed is None:
            continue
        sized = True
        if newest_fits and seconds > (spec.scale_up_window_seconds or 5):
            continue  # a load that fell shows in a long window's rate for minutes after it is gone
        # Whether from the rate's lower bound as observed, how many from the rate itself carried
        # ahead: once a window proves that more are needed, a step is met in one move, not a
        # replica a tick; a rise projected from noise proves nothing.
        proof = with_backlog(observed, history[-1], model, current, sigmas).bound(-sigmas)
        if needed(model, spec, proof, factor) > current:
            demand = with_backlog(carried_ahead(history, observed, model, now, seconds), history[-1], model, current)
            n = needed(model, spec, demand, factor)
            wishes.append((n, f"rate {demand.rate:.2f}/s over {seconds:g}s, prompts {demand.prompt:.0f} and "
                              f"outputs {demand.output:.0f} tokens need {n} by the performance model "
                              f"(bias {factor:.2f})"))
    # Queue, P99 missed: a miss overrides the model only when sustained (the bias takes the rest).
    # Without a length mix to size by (a service's first requests), concurrency as the reactive
    # policy reads it.
    evidence = autoscaler.up_wish(history, spec, math.inf if sized else target, current, now, last_change,
                                  MISS_WINDOWS)
    if evidence is not None:
        wishes.append(evidence)
    if wishes:
        return autoscaler.scaled_up(*max(wishes), spec, current, missing)
    if missing:
        return Decision(current, f"holding at {current}", missing)
    if autoscaler.idle(history, spec, current, now, last_change):
        return Decision(0, f"no requests for {spec.scale_to_zero_idle_seconds}s")
    # Down on the point estimate when it is above the proven bias: up and down differ by the
    # bias's uncertainty, so that a load between them moves neither way.
    down = _down(history, spec, model, current, now, last_change, stretches,
                 max(factor, model_bias.multiplier(newest)))
    if down is not None:
        wanted, why = down
        return Decision(max(1, autoscaler.bounded(wanted, spec, current)), why)
    return Decision(current, f"the load fits {current} by the performance model (bias {factor:.2f})")
