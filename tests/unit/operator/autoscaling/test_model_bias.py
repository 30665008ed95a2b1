"""The bias the predictive policy learns from observed latencies, pure, and the scale-down
rules that rest on it: no return to a count whose load the model has been seen to misjudge."""
from __future__ import annotations

import math

from kaon_operator import api
from kaon_operator.autoscaling import model_bias, predictive
from kaon_operator.autoscaling.autoscaler import Sample
from kaon_operator.autoscaling.model_bias import Judged
from kaon_operator.autoscaling.perf_model import PerfModel

MODEL = PerfModel(a=0.02, b=0.0015, c=0.0004, cold_start_seconds=30.0)
TICK = 5.0
SPEC = api.AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=10, target_p99_latency_seconds=0.3,
                           latency_metric="ttft", policy="predictive", profile="engine-profile")


def stretch(start: float, seconds: float, ready: int, rate: float, ttft: float,
            slow_share: float = 0.0, waiting: float = 0.0) -> list[Sample]:
    """Scrapes of `ready` replicas at `rate` requests/s of 144-token prompts, each request in
    `ttft` seconds (a `slow_share` of them in twice the target), `waiting` queued."""
    finished = rate * TICK
    slow = finished * slow_share
    latency = ((ttft, finished - slow), (0.6, finished), (math.inf, finished)) if slow else \
        ((ttft, finished), (math.inf, finished))
    return [Sample(time=start + i * TICK, ready=ready, running=3.0, waiting=waiting, finished=finished, latency=latency,
                   prompt_tokens=finished * 144, output_tokens=finished * 72) for i in range(int(seconds / TICK))]


def test_a_bias_is_carried_only_to_a_load_no_heavier_than_it_was_seen_at():
    fine, slow = ((0.2, 100.0), (math.inf, 100.0)), ((0.4, 100.0), (math.inf, 100.0))
    stretches = [Judged(fine, 0.2, 0.25), Judged(slow, 0.2, 0.45)]
    assert model_bias.at_load(stretches, 0.4, 1.0) > 1.9  # the heavier stretch was twice as slow as predicted
    assert model_bias.at_load(stretches, 0.5, 1.0) == 1.0  # nothing seen that heavy: the current bias
    assert model_bias.at_load(stretches, 0.4, 2.0) == 2.0  # never below the current one


def test_the_load_of_a_confident_miss_is_a_ceiling():
    assert model_bias.utilization_ceiling(stretch(0, 600, 4, 6.0, 0.2), MODEL, SPEC) == model_bias.MAX_UTILIZATION
    missed = stretch(0, 600, 3, 6.3, 0.2, slow_share=0.05) + stretch(600, 600, 4, 6.0, 0.2)
    ceiling = model_bias.utilization_ceiling(missed, MODEL, SPEC)
    assert ceiling == MODEL.predict(6.3 / 3, 144, 72).utilization


def test_latencies_right_after_a_change_set_no_ceiling():
    # A scale-up from 2 to 3: its first minute finishes what queued on 2 (30% over twice the target), then
    # 3 carry the same load well. The miss belongs to the backlog, not to 3 replicas at this load: no ceiling
    # (learnt, it held 6 replicas through a later burst that 4 carried: issue 53's idle-burst).
    history = stretch(0, 600, 2, 2.0, 0.1) + stretch(600, 60, 3, 2.0, 0.1, slow_share=0.3) + \
        stretch(660, 30, 3, 2.0, 0.1)
    assert model_bias.utilization_ceiling(history, MODEL, SPEC) == model_bias.MAX_UTILIZATION
    # The same miss a minute after the change, settled, is a ceiling.
    settled = stretch(0, 600, 2, 2.0, 0.1) + stretch(600, 60, 3, 2.0, 0.1) + \
        stretch(660, 60, 3, 2.0, 0.1, slow_share=0.3) + stretch(720, 30, 3, 2.0, 0.1)
    assert model_bias.utilization_ceiling(settled, MODEL, SPEC) == MODEL.predict(2.0 / 3, 144, 72).utilization


def test_no_scale_down_into_the_count_the_last_scale_up_left():
    # Three replicas ran 40% slower than the model says (just inside the target, no miss), so
    # the bias rose and a fourth came; on four the model is right again, and the newest bias
    # says three would do. They would not: the history has seen three at this load.
    history = stretch(0, 600, 3, 6.3, 0.295) + stretch(600, 1200, 4, 6.0, 0.19)
    now = history[-1].time
    assert model_bias.bias(history, MODEL, SPEC) < 1.1
    decision = predictive.decide(history, SPEC, 4, now, 600.0, model=MODEL)
    assert decision.replicas == 4, decision.reason
    # Without the three-replica stretch the same newest history goes down.
    assert predictive.decide(history[120:], SPEC, 4, now, 600.0, model=MODEL).replicas == 3


def test_no_scale_down_to_a_load_that_confidently_missed_the_target():
    # Three replicas missed the target with a queue (a transient the bias leaves out); four
    # are fine and the bias says three would do: the miss's load is a ceiling.
    missed = stretch(0, 600, 3, 6.3, 0.2, slow_share=0.05, waiting=30.0)
    history = missed + stretch(600, 1200, 4, 6.0, 0.19)
    assert not [j for j in model_bias.judged(missed, MODEL, SPEC)]
    decision = predictive.decide(history, SPEC, 4, history[-1].time, 600.0, model=MODEL)
    assert decision.replicas == 4, decision.reason


def judged_requests(requests: float, slow_share: float, slow: float = 1.3) -> Judged:
    """`requests` against a model P99 of 0.2 s: most at 0.1 s, a `slow_share` at `slow` x the model."""
    fast = requests * (1 - slow_share)
    return Judged(((0.1, fast), (0.2, fast), (0.2 * slow, requests), (math.inf, requests)), 0.2, 0.5)


def test_the_bias_moves_off_the_model_only_when_the_requests_prove_it():
    # 2% of 200 requests over the model: the point estimate says 1.1 or more, 200 requests do not prove it.
    few = [judged_requests(200, 0.02)]
    assert model_bias.multiplier(few) > 1.1
    assert model_bias.confident(few) == 1.0
    # The same share over 3,000 requests does: the least bias it proves, above 1 and at most the estimate.
    many = [judged_requests(3000, 0.03)]
    assert 1.0 < model_bias.confident(many) <= model_bias.multiplier(many)
    # Faster than the model, proven: below 1.
    assert model_bias.confident([judged_requests(3000, 0.0)]) < 1.0
    assert model_bias.confident([]) == 1.0


def test_latencies_right_after_a_change_are_the_backlog_s_and_teach_no_bias():
    # A scale-up from 2 to 3: the first minute on 3 finishes what queued on 2 (a third over twice the target).
    history = stretch(0, 600, 2, 2.0, 0.1) + stretch(600, 60, 3, 2.0, 0.1, slow_share=0.3) + \
        stretch(660, 300, 3, 2.0, 0.1)
    assert all(j.requests and model_bias.multiplier([j]) < 2.0 for j in model_bias.judged(history, MODEL, SPEC))
    assert model_bias.bias(history, MODEL, SPEC) < 1.0
