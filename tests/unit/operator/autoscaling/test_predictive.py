"""The predictive policy, pure: histories of scrapes in, replicas out."""
from __future__ import annotations

import dataclasses
import math

from kaon_operator import api
from kaon_operator.autoscaling import autoscale_loop, autoscaler, model_bias, predictive, scraper
from kaon_operator.autoscaling.autoscaler import Sample
from kaon_operator.autoscaling.perf_model import PerfModel
from support.metrics_text import engine_metrics_text

MODEL = PerfModel(a=0.02, b=0.0015, c=0.0004, cold_start_seconds=30.0)
TICK = 5.0


def spec(**kw) -> api.AutoscalingSpec:
    fields = {"policy": "predictive", "profile": "engine-profile", **kw}
    return api.AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=10, target_p99_latency_seconds=0.3,
                               latency_metric="ttft", **fields)


def sample(t: float, ready: int, rate: float, prompt: float, ttft: float = 0.21, output: float = 72,
           answered: int | None = None, in_flight: float = 3.0) -> Sample:
    finished = rate * TICK
    latency = ((ttft, finished), (math.inf, finished))
    return Sample(time=t, ready=ready, answered=answered, running=in_flight, finished=finished, latency=latency,
                  prompt_tokens=finished * prompt, output_tokens=finished * output)


def steady(seconds: float, ready: int = 3, rate: float = 6.0, prompt: float = 144, **kw) -> list[Sample]:
    return [sample(i * TICK, ready, rate, prompt, **kw) for i in range(int(seconds / TICK))]


def decide(history, current: int = 3, s=None, last_change: float | None = None):
    return predictive.decide(history, s or spec(), current, history[-1].time, last_change, model=MODEL)


def test_steady_load_never_moves():
    history = steady(1800)
    for end in range(len(history) // 2, len(history)):  # every tick of the second quarter hour
        decision = decide(history[:end + 1])
        assert decision.replicas == 3, decision.reason


def test_a_longer_prompt_mix_at_the_same_rate_scales_up_before_the_p99_is_missed():
    history = steady(900) + [sample(900 + i * TICK, 3, 6.0, 400) for i in range(12)]
    # Latency is still fine (every request at 0.21 s) and concurrency did not move ...
    reactive = spec(policy="reactive", target_concurrency_per_replica=1.0)  # 3 in flight: at target on 3
    assert autoscaler.decide(history, reactive, 3, history[-1].time).replicas == 3
    # ... but the model sees three times the prefill work coming at the same rate.
    decision = decide(history)
    assert decision.replicas > 3 and "prompts 400" in decision.reason


def test_fewer_replicas_only_when_the_whole_window_fits_them():
    quiet = steady(900, rate=2.0)
    assert decide(quiet, current=5, last_change=-1000).replicas < 5
    # One busy minute inside the stabilization window keeps the replicas.
    busy = [sample(900 + i * TICK, 5, 12.0, 144) for i in range(12)]
    calm = [sample(960 + i * TICK, 5, 2.0, 144) for i in range(24)]
    assert decide(quiet + busy + calm, current=5, last_change=-1000).replicas == 5


def test_missing_metrics_hold():
    history = steady(900)
    history[-1] = sample(history[-1].time, 3, 6.0, 144, answered=2)
    decision = decide(history)
    assert decision.replicas == 3 and decision.metrics_missing
    quiet = steady(900, rate=1.0)
    quiet[-1] = sample(quiet[-1].time, 5, 1.0, 144, answered=4)
    assert decide(quiet, current=5, last_change=-1000).replicas == 5  # never down on a partial scrape


def test_the_observed_p99_corrects_the_model_within_bounds():
    fast = model_bias.bias(steady(900, ttft=0.1), MODEL, spec())
    slow = model_bias.bias(steady(900, ttft=0.3), MODEL, spec())
    assert fast < 1 < slow
    assert model_bias.bias(steady(900, ttft=60.0), MODEL, spec()) == model_bias.BIAS_BOUNDS[1]
    # A model that says the replicas are slower than they are keeps fewer when corrected.
    assert decide(steady(900, rate=9.0, ttft=0.15)).replicas < decide(steady(900, rate=9.0, ttft=0.4)).replicas


def test_a_rising_rate_is_met_a_cold_start_ahead():
    flat = steady(600, rate=4.0)
    rising = flat + [sample(600 + i * TICK, 3, 4.0 + 0.4 * i, 144) for i in range(12)]
    now = predictive.window_load(rising, spec(), rising[-1].time, 60)
    assert predictive.carried_ahead(rising, now, MODEL, rising[-1].time, 60).rate > now.rate
    flat_load = predictive.window_load(flat, spec(), flat[-1].time, 60)
    assert predictive.carried_ahead(flat, flat_load, MODEL, flat[-1].time, 60).rate == predictive.load(flat[-12:]).rate


def test_the_loop_counts_tokens_from_per_pod_baselines_and_reads_a_profile():
    def pod(requests, prompt, generated, lengths=None):
        return scraper.PodMetrics(requests_total=requests, prompt_tokens_total=prompt,
                                  generation_tokens_total=generated, finished_output_tokens_total=lengths)

    baselines, _, _ = autoscale_loop.advance({}, {"a"}, {"a": pod(10, 1000, 500, 450)}, "ttft")
    assert autoscale_loop.token_deltas({}, {"a": pod(10, 1000, 500)}) == (0, 0, 0)  # a first scrape: a baseline only
    assert autoscale_loop.token_deltas(baselines, {"a": pod(12, 1300, 600, 530)}) == (300, 100, 80)
    assert autoscale_loop.token_deltas(baselines, {"a": pod(1, 40, 7, 5)}) == (40, 7, 5)  # restarted: from zero
    assert autoscale_loop.token_deltas(baselines, {"a": pod(12, 1300, 600)}) == (300, 100, None)  # an older engine
    assert autoscale_loop.read_profile(MODEL.to_json()) == MODEL
    assert autoscale_loop.read_profile("not json") is None and autoscale_loop.read_profile(None) is None


def test_the_length_mix_is_read_from_the_engines_own_token_counters():
    parsed = scraper.parse(engine_metrics_text(0, 2, [], 2, prompt_tokens=1440, generation_tokens=720,
                                               output_lengths=(30, 90)))
    assert (parsed.requests_total, parsed.prompt_tokens_total, parsed.generation_tokens_total) == (2, 1440, 720)
    assert parsed.finished_output_tokens_total == 120
    assert scraper.parse(engine_metrics_text(0, 2, [], 2)).finished_output_tokens_total == 0
    assert scraper.parse("kaon_num_requests_running 1\n").finished_output_tokens_total is None  # an older engine


def test_a_rising_load_is_sized_by_the_lengths_of_finished_requests_not_the_lagging_token_count():
    # Steady at 1 request/s of 72-token outputs, then 4/s for 20 s: the new requests have
    # barely started decoding, so generated tokens per arrival read a third of the truth.
    def tick(t: float, rate: float, running: float) -> Sample:
        return Sample(time=t, ready=1, running=running, finished=TICK * 1.0, prompt_tokens=144 * rate * TICK,
                      output_tokens=72 * TICK * 1.0, finished_output_tokens=72 * TICK * 1.0)

    history = [tick(i * TICK, 1.0, 8.0) for i in range(120)]
    history += [tick(600 + i * TICK, 4.0, 8.0 + 15.0 * (i + 1)) for i in range(4)]
    recent = history[-5:]
    assert predictive.load(recent).output == 72
    lagging = [dataclasses.replace(s, finished_output_tokens=None) for s in history]
    assert predictive.load(lagging[-5:]).output < 30
    sized = decide(history, current=1, last_change=-1000)
    assert sized.replicas > decide(lagging, current=1, last_change=-1000).replicas, sized.reason


def test_a_bias_on_a_few_slow_requests_does_not_move_a_steady_load():
    # One replica carries 2 requests/s; the last two minutes: 240 requests, 7% of them at 1.3x the model's P99.
    model_p99 = predictive.latency(MODEL, spec(), MODEL.predict(2.0, 144, 72), 72)

    def ticks(start: float, count: int, fast: float) -> list[Sample]:  # 10 requests a tick, `fast` of them in 0.9x
        return [Sample(time=start + i * TICK, ready=1, running=3.0, finished=10.0,
                       latency=((0.9 * model_p99, fast), (1.3 * model_p99, 10.0), (math.inf, 10.0)),
                       prompt_tokens=1440, output_tokens=720) for i in range(count)]

    calm, slow = ticks(0, 120, 10.0), ticks(600, 24, 9.3)
    # The point estimate (over the newest 1,000 requests) is above the model; the requests do not prove it.
    assert model_bias.multiplier(model_bias.newest(model_bias.judged(calm + slow, MODEL, spec()))) > 1.0
    decision = decide(calm + slow, current=1, last_change=-1000)
    assert decision.replicas == 1 and "bias 1.00" in decision.reason, decision.reason


def test_a_p99_miss_overrides_the_model_only_when_it_holds_in_two_stretches():
    def stretch(start: float, over: float) -> list[Sample]:  # 100 requests, `over` of them at 0.6 s (target 0.3)
        fast = 10.0 - over / 10
        return [Sample(time=start + i * TICK, ready=1, running=3.0, finished=10.0,
                       latency=((0.1, fast), (0.3, fast), (0.6, 10.0), (math.inf, 10.0)),
                       prompt_tokens=1440, output_tokens=720) for i in range(10)]

    calm = [s for start in range(0, 600, 50) for s in stretch(start, 0)]
    once = calm + stretch(600, 0) + stretch(650, 5)
    assert autoscaler.recent_miss(once, 0.3, 0) is not None  # the reactive policy's single-stretch test fires
    assert decide(once, current=1, last_change=-1000).replicas == 1
    twice = calm + stretch(600, 5) + stretch(650, 5)
    decision = decide(twice, current=1, last_change=-1000)
    assert decision.replicas > 1 and "P99" in decision.reason, decision.reason


def test_a_latency_floor_no_replica_removes_does_not_send_the_replicas_to_the_maximum():
    # 350-token prompts: one long prompt's own prefill is about the 0.3 s target on any count.
    demand = predictive.Load(rate=2.0, prompt=350, output=72, requests=1000, seconds=500)
    floor = [predictive.latency(MODEL, spec(), MODEL.predict(2.0 / n, 350, 72), 72) for n in (5, 10)]
    assert floor[0] - floor[1] < predictive.MARGIN * 0.3 and floor[1] > 0.3 * (1 - predictive.MARGIN)
    wanted = predictive.needed(MODEL, spec(), demand, 1.0)
    assert wanted <= 5
    assert predictive.fits(MODEL, spec(), demand, wanted, 0.0)  # within utilization and batch all the same


def test_a_backlog_left_by_a_burst_is_cleared_over_a_cold_start_not_left_to_the_steady_state():
    calm = steady(600, rate=6.0)
    assert decide(calm).replicas == 3  # the rate alone fits the three
    # The same rate, but 900 requests in flight for two minutes: what queued while replicas started
    # is still to be served (the rate's window, after the jump, sees no arrivals beyond the rate).
    backlog = calm[:-24] + [sample(s.time, 3, 6.0, 144, in_flight=900.0) for s in calm[-24:]]
    demand = predictive.load([s for s in backlog if s.time > backlog[-1].time - 60])
    assert predictive.with_backlog(demand, backlog[-1], MODEL, 3).rate > demand.rate + 2
    assert decide(backlog).replicas > 3


def test_a_scale_down_also_heeds_the_bias_the_requests_point_at_before_they_prove_it():
    # Three replicas at 2.5 requests/s; the last two minutes, 7% of requests at 1.3x the model's P99:
    # not proven (a scale-up would not take it), but fewer replicas are judged with it.
    model_p99 = predictive.latency(MODEL, spec(), MODEL.predict(2.5 / 3, 144, 72), 72)
    history = [Sample(time=i * TICK, ready=3, running=3.0, finished=12.5,
                      latency=((0.9 * model_p99, 12.5 * (0.93 if i >= 96 else 1.0)), (1.3 * model_p99, 12.5),
                               (math.inf, 12.5)), prompt_tokens=12.5 * 144, output_tokens=12.5 * 72)
               for i in range(120)]
    newest = model_bias.newest(model_bias.judged(history, MODEL, spec()))
    assert model_bias.confident(newest) < model_bias.multiplier(newest)
    assert decide(history, last_change=-1000).replicas == 2  # not 1, which the proven bias alone allows


def test_a_short_window_counts_arrivals_from_the_scrape_that_opens_it():
    # 5 requests finished a tick; concurrency jumped from 3 to 13 two ticks ago and stayed.
    history = steady(300, rate=1.0) + [sample(300.0, 3, 1.0, 144, in_flight=13.0),
                                      sample(305.0, 3, 1.0, 144, in_flight=13.0)]
    counted = predictive.arrivals(history, 295.0, 305.0)
    assert counted is not None and math.isclose(counted.rate, 2.0)  # 10 finished + 10 more in flight over 10 s
    assert math.isclose(predictive.load(history[-2:]).rate, 1.0)  # the samples alone miss the jump


def test_a_step_in_rate_is_met_in_one_move_sized_by_the_rate_not_its_lower_bound():
    s = spec(max_step=10)
    history = steady(600, ready=1, rate=1.0) + [sample(600 + i * TICK, 1, 5.0, 144) for i in range(4)]
    decision = decide(history, current=1, s=s, last_change=-1000)
    windows = ((60, predictive.UP_SIGMAS), *predictive.EXTRA_WINDOWS)
    bias = model_bias.confident(model_bias.newest(model_bias.judged(history, MODEL, s)))
    lower = [predictive.needed(MODEL, s, predictive.window_load(history, s, history[-1].time, w).bound(-z), bias)
             for w, z in windows]
    # Each window's lower bound proves more are needed; the rate itself says how many.
    assert max(lower) > 1 and decision.replicas > max(lower), (lower, decision.reason)


def test_from_zero_held_requests_are_sized_by_the_lengths_the_history_knows():
    # The first requests after an idle spell wait at the router while a replica starts: no
    # tokens are counted yet, so the window alone reads them as zero tokens long.
    served = steady(600, ready=1, rate=1.0)
    idle = [Sample(time=600 + i * TICK, ready=0, held_by_router=0.0) for i in range(60)]
    held = [Sample(time=900 + i * TICK, ready=0, starting=1, held_by_router=40.0 * (i + 1)) for i in range(3)]
    decision = decide(served + idle + held, current=1, last_change=900)
    assert decision.replicas > 1 and "performance model" in decision.reason, decision.reason
    # A service that never finished a request has no length mix: concurrency decides, as in the reactive policy.
    fresh = [Sample(time=i * TICK, ready=0, held_by_router=0.0) for i in range(60)]
    fresh += [dataclasses.replace(s, time=300 + i * TICK) for i, s in enumerate(held)]
    decision = decide(fresh, current=1, last_change=300)
    assert decision.replicas > 1 and "concurrency" in decision.reason, decision.reason


def test_a_load_just_past_a_replica_boundary_shows_over_minutes_before_the_scale_up_window_proves_it():
    s = spec().model_copy(update={"target_p99_latency_seconds": None})  # sized by utilization alone
    history = steady(1200, ready=3, rate=13.5)  # 60 s hold 810 requests: their lower bound still fits 3
    decision = decide(history, current=3, s=s, last_change=-1000)
    assert decision.replicas == 4 and "over 300s" in decision.reason, decision.reason


def test_no_replica_is_sized_past_its_kv_cache():
    history = steady(900, ready=3, rate=6.0)
    assert decide(history).replicas == 3
    # The same load and latencies, but each replica's cache holds fewer tokens than its running sequences need.
    per_replica = MODEL.predict(2.0, 144, 72).kv_tokens
    small = dataclasses.replace(MODEL, kv_cache_tokens=int(per_replica * 0.8))
    decision = predictive.decide(history, spec(), 3, history[-1].time, None, model=small)
    assert decision.replicas > 3, decision.reason


def test_a_burst_from_zero_is_not_sized_down_on_a_window_that_holds_the_idle_seconds():
    """Issue 53 (the simulator's idle-burst): from zero the standbys woke at once; 15 s later the 120 s window's
    rate, the idle seconds averaged in, read a tenth of the burst and took 3 replicas back to 1."""
    s = spec(scale_down_stabilization_seconds=120, scale_up_window_seconds=15)
    idle = [sample(i * TICK, 0, 0.0, 144, in_flight=0.0) for i in range(40)]  # 200 s at zero
    burst = [sample(200 + i * TICK, 3, 6.0, 144) for i in range(1, 5)]  # 20 s of the burst on 3 replicas
    decision = decide(idle + burst, current=3, s=s, last_change=201.0)
    assert decision.replicas == 3, decision.reason
    # A whole window of serving later, the same low rate does take replicas away.
    quiet = [sample(220 + i * TICK, 3, 0.5, 144, in_flight=1.0) for i in range(1, 30)]
    assert decide(idle + burst + quiet, current=3, s=s, last_change=201.0).replicas < 3


def test_a_load_that_ended_is_not_scaled_up_for_by_the_long_windows():
    """After a burst ended, the 300 s window still read its rate while none came: 1 -> 3 and back again every
    20 s for two minutes. The newest scale-up window fits the current replicas, so the long windows prove nothing."""
    s = spec(scale_down_stabilization_seconds=120, scale_up_window_seconds=15)
    busy = steady(300, ready=1, rate=6.0)
    ended = [sample(300 + i * TICK, 1, 0.0, 144, in_flight=0.0) for i in range(1, 7)]  # 30 s of nothing
    decision = decide(busy + ended, current=1, s=s, last_change=0.0)
    assert decision.replicas == 1, decision.reason
    # While the load lasts, the same long windows still scale a slow rise up.
    assert decide(busy, current=1, s=s, last_change=0.0).replicas > 1
