"""The autoscaling policy: (history of samples, spec, replicas now, time) -> (replicas wanted, why).

A pure function, so every trace (steady, step, burst, ramp, noise, idleness, a failed
scrape) is a unit test, and bench/autoscale_sim.py runs this very function against a
calibrated model of the engine.

- **Concurrency is the main signal**: requests running + waiting in the engines + held at
  the router, against a per-replica target (`targetConcurrencyPerReplica`, by default
  `targetUtilization` x the engine's `maxNumSeqs`). A replica that is busy but not queueing
  counts as busy, so a steady load never looks idle.
- **Up**: to ceil(mean concurrency over `scaleUpWindowSeconds` / target) once that mean is
  more than TOLERANCE above what the replicas carry; at once (a burst, like Knative's
  panic mode) when the latest sample alone wants PANIC_FACTOR x the replicas. Queue depth
  per ready replica above `targetQueueDepthPerReplica` over the whole window, and a P99
  over `targetP99LatencySeconds`, add replicas too (they say capacity is short even when
  the concurrency target was set too high). They are effects, not amounts, so they act
  only when no replica is starting and the last change is a window old.
- **Down**: only when the *peak* concurrency of the last `scaleDownStabilizationSeconds`
  fits fewer replicas with TOLERANCE to spare, with no queue and no P99 over target in that
  window, and no change for a scale-up window. A steady load therefore never moves
  replicas. With a latency target, "fits" also means staying under the concurrency per
  replica at which P99 last missed the target (remembered for an hour), so a latency-bound
  service does not scale down into the same miss again.
- **P99** comes from summed per-tick histogram deltas. It adds replicas only when more than
  1% of at least MIN_LATENCY_REQUESTS requests missed the target with 99% confidence (the
  window widens back, to the last change at most, until it shows that): 3 slow requests
  of 100 are not a trend.
- **Fail safe**: a sample where some ready replica did not answer holds the replica count
  unless the replicas that did answer already ask for more (the decision says why, for a
  condition and an Event). A scale-down (or to-zero) window needs MIN_COMPLETE_SHARE of
  its scrapes usable and is judged on those, pods that missed one counted as loaded as
  the others.
- **Zero**: with minReplicas 0, to zero after `scaleToZeroIdleSeconds` without a request,
  and never while a replica is still starting; back from zero as soon as the router holds
  a request.
- Never below minReplicas nor above maxReplicas (a wish above it is reported as capped);
  at most `maxStep` replicas per decision.

Over 300 lines for a stated reason: the whole policy, the one function the simulator runs,
with the rules above beside the code that applies them.
"""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from kaon_operator.api import MAX_WINDOW_SECONDS, AutoscalingSpec
from kaon_operator.autoscaling import histogram

PANIC_FACTOR = 2.0  # the latest sample alone wants this many times the replicas: react now
TOLERANCE = 0.1  # within 10% of target is "at target", both ways (HPA's default tolerance)
MIN_LATENCY_REQUESTS = 100  # the P99 of fewer requests is little more than the slowest one
CONFIDENCE_Z = 2.326  # a P99 miss must hold with 99% confidence (one-sided), not be a few unlucky requests
MIN_COMPLETE_SHARE = 0.9  # of a window's scrapes, enough to judge a scale-down by
MIN_ANSWERED_SHARE = 0.75  # of a scrape's pods, enough for it to count in such a window
HISTORY_MARGIN_SECONDS = 60


@dataclass(frozen=True, slots=True)
class Sample:
    """What one scrape of an InferenceService's engine pods (and the routers) showed."""

    time: float
    ready: int
    """Engine pods ready when scraped."""
    answered: int | None = None
    """Of those, the ones whose /metrics came back (None: all of them)."""
    waiting: float = 0.0
    running: float = 0.0
    starting: int = 0
    """Pods created but not ready yet (image pull, weight load)."""
    finished: float = 0.0
    """Requests finished since the previous sample."""
    latency: histogram.Buckets = ()
    """Cumulative histogram of the latency metric over the requests finished since the previous sample."""
    held_by_router: float | None = 0.0
    """Requests the routers hold because no pod is ready; None when no router answered."""
    prompt_tokens: float = 0.0
    output_tokens: float = 0.0
    """Prompt tokens accepted and tokens generated since the previous sample (the length mix)."""
    finished_output_tokens: float | None = None
    """The output lengths of the requests finished since the previous sample, summed (None: the
    engines do not report them). Generated tokens lag arrivals while a load rises (the new
    requests have not decoded yet), so they understate the mean output just when it matters."""

    @property
    def complete(self) -> bool:
        return self.answered is None or self.answered >= self.ready

    @property
    def concurrency(self) -> float:
        return self.waiting + self.running + (self.held_by_router or 0.0)

    @property
    def mostly_answered(self) -> bool:
        """Enough pods answered to judge a window by (with many pods, some scrape is often missing)."""
        return self.complete or (self.answered or 0) >= MIN_ANSWERED_SHARE * self.ready

    @property
    def estimated_concurrency(self) -> float:
        """Concurrency with the pods that did not answer assumed as loaded as those that did."""
        if self.complete or not self.answered:
            return self.concurrency
        return (self.waiting + self.running) * self.ready / self.answered + (self.held_by_router or 0.0)


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str
    metrics_missing: str | None = None
    """Set when the metrics were incomplete and the count was held for that reason."""
    capped_from: int | None = None
    """The replicas the load asked for when maxReplicas stopped it."""


def concurrency_target(spec: AutoscalingSpec, max_num_seqs: int) -> float:
    """Requests one replica should carry: set in the spec, or a share of the engine's batch."""
    return spec.target_concurrency_per_replica or max(1.0, spec.target_utilization * max_num_seqs)


def history_seconds(spec: AutoscalingSpec) -> float:
    """How much history the policy reads for this spec."""
    if spec.target_p99_latency_seconds:  # the latency ceiling is remembered for as long as history is kept
        return MAX_WINDOW_SECONDS + HISTORY_MARGIN_SECONDS
    return max(spec.scale_up_window_seconds, spec.scale_down_stabilization_seconds,
               spec.scale_to_zero_idle_seconds or 0) + HISTORY_MARGIN_SECONDS


def window_p99(samples: list[Sample]) -> tuple[float | None, float]:
    """(P99 over the samples' finished requests, or None with fewer than MIN_LATENCY_REQUESTS;
    how many finished)."""
    merged = histogram.add_buckets(*(s.latency for s in samples))
    count = merged[-1][1] if merged else 0.0
    return (histogram.quantile(merged, 0.99) if count >= MIN_LATENCY_REQUESTS else None), count


def misses_target(samples: list[Sample], goal: float) -> tuple[bool, float | None, float, float]:
    """Whether more than 1% of the samples' requests took longer than `goal`, with 99%
    confidence (Wilson's lower bound on the share over it): (missed, P99, over, requests).
    A window of 100 requests with 3 slow ones is not a miss; 4 are."""
    return histogram_misses(histogram.add_buckets(*(s.latency for s in samples)), goal)


def histogram_misses(merged: histogram.Buckets, goal: float) -> tuple[bool, float | None, float, float]:
    """misses_target on the requests of one (merged) histogram."""
    n = merged[-1][1] if merged else 0.0
    if n < MIN_LATENCY_REQUESTS:
        return False, None, 0.0, n
    over = histogram.count_above(merged, goal)
    z2, share = CONFIDENCE_Z ** 2, over / n
    spread = CONFIDENCE_Z * math.sqrt(share * (1 - share) / n + z2 / (4 * n * n))
    lower = (share + z2 / (2 * n) - spread) / (1 + z2 / n)
    return lower > 0.01, histogram.quantile(merged, 0.99), over, n


def recent_miss(history: list[Sample], goal: float, since: float) -> tuple[float, float, float] | None:
    """(P99, requests over the goal, requests) of the newest samples after `since` that show a
    confident miss of `goal`, widening back until they do or the samples run out; None if none."""
    merged: histogram.Buckets = ()
    for sample in reversed(history):
        if sample.time <= since:
            break
        merged = histogram.add_buckets(merged, sample.latency)
        missed, p99, over, n = histogram_misses(merged, goal)
        if missed and p99 is not None:
            return p99, over, n
    return None


def sustained_miss(history: list[Sample], goal: float, since: float, windows: int
                   ) -> tuple[float, float, float] | None:
    """As recent_miss, but the miss must hold in each of the newest `windows` disjoint stretches
    of MIN_LATENCY_REQUESTS requests after `since`, each judged on its own: a policy checks
    every tick over a window that slides, so one confident-looking stretch is, now and then,
    only noise (4 of 100 over happens to 2% of stretches at a true 1%); `windows` of them in a
    row is not."""
    merged: histogram.Buckets = ()
    stretch: histogram.Buckets = ()
    found = 0
    for sample in reversed(history):
        if sample.time <= since:
            break
        stretch = histogram.add_buckets(stretch, sample.latency)
        missed, _, _, n = histogram_misses(stretch, goal)
        if n < MIN_LATENCY_REQUESTS:
            continue
        if not missed:
            return None
        merged, stretch, found = histogram.add_buckets(merged, stretch), (), found + 1
        if found == windows:
            _, p99, over, total = histogram_misses(merged, goal)
            return (p99, over, total) if p99 is not None else None
    return None


def latency_ceiling(history: list[Sample], spec: AutoscalingSpec) -> float | None:
    """The lowest concurrency per ready replica at which the latency target was confidently
    missed: a scale-down must not load the replicas past it, or it would only bring the miss
    back. Judged over stretches of MIN_LATENCY_REQUESTS requests, cut newest first, that keep
    the same ready replicas and none starting: across a change, latencies measured now belong
    to load from before, and would set a false ceiling."""
    goal = spec.target_p99_latency_seconds
    if not goal:
        return None
    return min((sum(s.concurrency for s in stretch) / len(stretch) / stretch[0].ready
                for stretch in missed_stretches(history, goal)), default=None)


def missed_stretches(history: list[Sample], goal: float, usable: list[bool] | None = None
                     ) -> Iterator[list[Sample]]:
    """The stretches of the history (each newest first) of MIN_LATENCY_REQUESTS requests or more,
    cut newest first, that keep the same ready replicas and none starting, and confidently
    missed `goal`. `usable` (one flag per sample; None: all) cuts a stretch at the samples it
    marks False as at a starting one."""
    stretch: list[Sample] = []
    merged: histogram.Buckets = ()
    for i in range(len(history) - 1, -1, -1):
        sample = history[i]
        unusable = sample.starting or not sample.ready or (usable is not None and not usable[i])
        if unusable or (stretch and sample.ready != stretch[0].ready):
            stretch, merged = [], ()
            if unusable:
                continue
        stretch.append(sample)
        merged = histogram.add_buckets(merged, sample.latency)
        missed, _, _, n = histogram_misses(merged, goal)
        if n >= MIN_LATENCY_REQUESTS:
            if missed:
                yield stretch
            stretch, merged = [], ()


def _window(history: list[Sample], now: float, seconds: float) -> list[Sample] | None:
    """The samples of the last `seconds` (at least the latest), or None when the history
    does not reach back that far."""
    if not history or history[0].time > now - seconds:
        return None
    return [s for s in history if s.time >= now - seconds] or [history[-1]]


def bounded(desired: int, spec: AutoscalingSpec, current: int) -> int:
    step_bounded = max(current - spec.max_step, min(current + spec.max_step, desired))
    return max(spec.min_replicas, min(spec.max_replicas, step_bounded))


def up_wish(history: list[Sample], spec: AutoscalingSpec, target: float, current: int, now: float,
        last_change: float | None, miss_windows: int = 1) -> tuple[int, str] | None:
    """The replicas the load asks for beyond `current` (None: none); a P99 miss counts when
    it holds over `miss_windows` stretches (1: the newest, widened until it shows)."""
    latest = history[-1]
    if latest.concurrency >= PANIC_FACTOR * current * target:
        return (math.ceil(latest.concurrency / target),
                f"concurrency {latest.concurrency:g} > {PANIC_FACTOR:g}x target {target:g} x {current} (burst)")
    window = _window(history, now, spec.scale_up_window_seconds)
    if window is None:
        return None
    window = [s for s in window if s.complete]
    if not window:
        return None
    wishes = []
    mean = sum(s.concurrency for s in window) / len(window)
    if mean > current * target * (1 + TOLERANCE):
        wishes.append((math.ceil(mean / target), f"concurrency {mean:.1f} > target {target:g} x {current}"))
    # Queue and latency are effects, not amounts: they wait until replicas that are starting
    # are ready, and until the last change has had a whole window to show its effect.
    settled = last_change is None or last_change < now - spec.scale_up_window_seconds
    window = [s for s in window if last_change is None or s.time > last_change]
    if latest.starting == 0 and settled and window:
        queues = [s.waiting / s.ready for s in window if s.ready]
        if len(queues) == len(window) and min(queues) > spec.target_queue_depth_per_replica:
            least_waiting = min(s.waiting for s in window)
            wishes.append((current + max(1, math.ceil(least_waiting / target)), f"queue depth {min(queues):.1f} "
                           f"per replica > target {spec.target_queue_depth_per_replica:g}"))
        goal = spec.target_p99_latency_seconds
        lookback = now - max(spec.scale_up_window_seconds, spec.scale_down_stabilization_seconds)
        since = max(lookback, last_change if last_change is not None else lookback)
        miss = None if not goal else recent_miss(history, goal, since) if miss_windows == 1 else \
            sustained_miss(history, goal, since, miss_windows)
        if goal and miss:
            p99, over, n = miss
            wishes.append((max(current + 1, math.ceil(current * min(p99 / goal, PANIC_FACTOR))),
                           f"P99 {spec.latency_metric} {p99:.2f}s > target {goal:g}s "
                           f"({over:.0f} of {n:.0f} requests over)"))
    wanted = max(wishes, default=None)
    return wanted if wanted and wanted[0] > current else None


def idle(history: list[Sample], spec: AutoscalingSpec, current: int, now: float,
          last_change: float | None) -> bool:
    seconds = spec.scale_to_zero_idle_seconds
    if spec.min_replicas > 0 or not seconds or (last_change is not None and last_change > now - seconds):
        return False
    window = _window(history, now, seconds)
    if window is None or history[-1].starting or not history[-1].complete:
        return False
    known = [s for s in window if s.complete and s.held_by_router is not None]
    return len(known) >= MIN_COMPLETE_SHARE * len(window) and all(
        s.held_by_router == 0 and s.concurrency == 0 and s.finished == 0 for s in known)


def _down(history: list[Sample], spec: AutoscalingSpec, target: float, current: int, now: float,
          last_change: float | None) -> tuple[int, str] | None:
    seconds = spec.scale_down_stabilization_seconds
    # The window's peak already remembers the load of any scale-up in it; waiting a scale-up
    # window after the last change lets that change show its effect first (and lets one
    # scale-down follow another without a whole stabilization window between them).
    if last_change is not None and last_change > now - min(seconds, spec.scale_up_window_seconds):
        return None
    window = _window(history, now, seconds)
    if window is None or not history[-1].complete:
        return None
    known = [s for s in window if s.mostly_answered and s.held_by_router is not None]
    if len(known) < MIN_COMPLETE_SHARE * len(window):
        return None
    window = known
    if any(s.ready and s.waiting / (s.answered or s.ready) > spec.target_queue_depth_per_replica for s in window):
        return None
    p99, _ = window_p99(window)
    goal = spec.target_p99_latency_seconds
    if goal and p99 is not None and p99 > goal * (1 - TOLERANCE):
        return None
    peak = round(max(s.estimated_concurrency for s in window), 1)
    ceiling = latency_ceiling(history, spec)
    per_replica = min(target, ceiling) if ceiling else target
    needed = max(1, math.ceil(peak / (per_replica * (1 - TOLERANCE))))
    if needed >= current:
        return None
    return needed, f"peak concurrency {peak:g} in {seconds}s fits {needed} at {per_replica:g} per replica"


def guard(history: list[Sample], spec: AutoscalingSpec, current: int, target: float) -> Decision | None:
    """The decisions every policy makes alike: bounds first, nothing to go on, and zero."""
    if current < spec.min_replicas or current > spec.max_replicas:
        within = max(spec.min_replicas, min(spec.max_replicas, current))
        return Decision(within, f"{current} replicas is outside {spec.min_replicas}..{spec.max_replicas}")
    if not history:
        return Decision(current, "no metrics yet")
    latest = history[-1]
    if latest.held_by_router is None and current == 0:
        return Decision(0, "holding at 0", metrics_missing="no router answered, so held requests are unknown")
    if current == 0:
        if not latest.held_by_router:
            return Decision(0, "idle")
        wanted = max(1, math.ceil(latest.held_by_router / target))
        return Decision(bounded(wanted, spec, 0), f"{latest.held_by_router:g} requests waiting at the router")
    return None


def missing_metrics(latest: Sample) -> str | None:
    return None if latest.complete else \
        f"{latest.ready - (latest.answered or 0)} of {latest.ready} ready replicas did not answer the scrape"


def scaled_up(wanted: int, why: str, spec: AutoscalingSpec, current: int, missing: str | None) -> Decision:
    return Decision(bounded(wanted, spec, current), why, missing,
                    capped_from=wanted if wanted > spec.max_replicas else None)


def decide(history: list[Sample], spec: AutoscalingSpec, current: int, now: float,
           last_change: float | None = None, *, max_num_seqs: int = 64) -> Decision:
    """`history` is oldest first; `last_change` is when replicas last changed (it survives
    operator restarts through the InferenceService's status); `max_num_seqs` is the engine's
    batch limit, which sets the default concurrency target."""
    target = concurrency_target(spec, max_num_seqs)
    early = guard(history, spec, current, target)
    if early is not None:
        return early
    latest, missing = history[-1], missing_metrics(history[-1])
    # Up is safe on partial metrics: the pods that did not answer can only add load.
    up = up_wish(history, spec, target, current, now, last_change)
    if up is not None:
        return scaled_up(*up, spec, current, missing)
    if missing:
        return Decision(current, f"holding at {current}", missing)
    if idle(history, spec, current, now, last_change):
        return Decision(0, f"no requests for {spec.scale_to_zero_idle_seconds}s")
    down = _down(history, spec, target, current, now, last_change)
    if down is not None:
        wanted, why = down
        return Decision(max(1, bounded(wanted, spec, current)), why)
    return Decision(current, f"concurrency {latest.concurrency:g} for {current} at target {target:g}")
