"""The autoscaling policy on simulated traces, and the metrics it reads from engine pods.

The simulation: demand is measured in replicas' worth of load, so with `r` replicas the
waiting requests per replica are `target x demand / r` and the load ratio is demand / r.
New replicas are ready at the next tick (the policy, not pod start-up, is under test).
"""
from __future__ import annotations

import math
import random

from kaon_operator import api, scraper
from kaon_operator.autoscaler import Decision, Sample, decide, load_ratio

TICK = 5.0


def spec(**kw) -> api.AutoscalingSpec:
    base = {"enabled": True, "min_replicas": 1, "max_replicas": 10, "target_queue_depth_per_replica": 4,
            "scale_up_window_seconds": 15, "scale_down_stabilization_seconds": 60, "max_step": 2}
    return api.AutoscalingSpec(**{**base, **kw})


def simulate(demand, s: api.AutoscalingSpec, seconds: float, start: int = 1, held=lambda t: 0.0):
    """Run the policy every TICK; return [(time, replicas, reason)] after each tick."""
    replicas, history, timeline, last_change, served = start, [], [], None, 0.0
    t = 0.0
    while t <= seconds:
        d = demand(t)
        served += 10 * d  # finished requests grow with demand; zero demand means none
        history.append(Sample(time=t, ready=replicas, queue_depth=s.target_queue_depth_per_replica * d,
                              running=min(d, replicas), requests_total=served, held_by_router=held(t)))
        history = [x for x in history if x.time >= t - 1000]
        decision = decide(history, s, replicas, t, last_change)
        if decision.replicas != replicas:
            last_change = t
        replicas = decision.replicas
        timeline.append((t, replicas, decision.reason))
        t += TICK
    return timeline


def replicas_at(timeline, t: float) -> int:
    return [r for when, r, _ in timeline if when <= t][-1]


def changes(timeline) -> list[tuple[float, int]]:
    out, prev = [], None
    for when, r, _ in timeline:
        if r != prev:
            out.append((when, r))
            prev = r
    return out


def test_step_increase_scales_in_steps_after_the_window_then_holds():
    timeline = simulate(lambda t: 1 if t < 60 else 5, spec(), 200)
    # 1 -> 5 is a burst (ratio 5 >= 2): the first tick after the step adds max_step; then the
    # ratio is 5/3, no longer a burst, so the rest waits for the scale-up window.
    assert changes(timeline) == [(0, 1), (60, 3), (75, 5)], changes(timeline)
    assert replicas_at(timeline, 200) == 5


def test_moderate_step_waits_for_the_scale_up_window():
    timeline = simulate(lambda t: 1 if t < 60 else 1.5, spec(), 200)  # ratio 1.5: not a burst
    assert changes(timeline) == [(0, 1), (75, 2)], changes(timeline)  # 60 + 15 s window
    assert "queue depth 6.0 per replica > target 4" in timeline[15][2]


def test_burst_reacts_within_one_tick_up_to_max_step_and_max_replicas():
    timeline = simulate(lambda t: 1 if t < 30 else 40, spec(max_replicas=6, max_step=3), 120)
    assert changes(timeline) == [(0, 1), (30, 4), (35, 6)], changes(timeline)
    assert timeline[6][2].endswith("(burst)")


def test_slow_ramp_follows_demand_without_overshoot():
    timeline = simulate(lambda t: 1 + 3 * min(t, 600) / 600, spec(), 700)
    rs = [r for _, r, _ in timeline]
    assert rs == sorted(rs), "a ramp up never scales down"
    for when, r, _ in timeline:
        assert r <= math.ceil(1 + 3 * min(when, 600) / 600) + 1, (when, r)
    assert replicas_at(timeline, 700) == 4


def test_noisy_signal_does_not_flap():
    rng = random.Random(7)
    noise = {}
    timeline = simulate(lambda t: noise.setdefault(t, rng.uniform(1.7, 2.3)), spec(), 900, start=2)
    moves = changes(timeline)[1:]
    assert len(moves) <= 2, moves  # at most one step up to cover the peaks, no oscillation
    assert all(r in (2, 3) for _, r, _ in timeline)


def test_idle_scales_down_after_stabilization_then_to_zero_and_back_from_the_router():
    s = spec(min_replicas=0, scale_to_zero_idle_seconds=120, scale_down_stabilization_seconds=60)
    demand = lambda t: 3 if t < 100 else 0  # noqa: E731
    held = lambda t: 2 if t >= 400 else 0  # noqa: E731
    timeline = simulate(demand, s, 420, start=3, held=held)
    moves = changes(timeline)
    # Down one stabilization window after the load stopped (at most max_step at a time and never
    # below one while only "quiet"), to zero after the idle period, up as soon as the router holds requests.
    assert moves == [(0, 3), (160, 1), (220, 0), (400, 1)], moves
    reasons = {when: reason for when, _, reason in timeline}
    assert reasons[160] == "queue depth 0.0 per replica <= target 4 for 60s"
    assert reasons[220] == "no requests for 120s"
    assert reasons[400] == "2 requests waiting at the router"


def test_latency_target_drives_scaling_when_it_is_the_worse_signal():
    s = spec(target_p99_latency_seconds=1.0, latency_metric="ttft")
    sample = Sample(time=0, ready=2, queue_depth=2, p99_seconds=3.0)
    ratio, why = load_ratio(sample, s)
    assert ratio == 3.0 and why == "P99 ttft 3.00s > target 1s"
    assert decide([sample], s, 2, 0) == Decision(4, "P99 ttft 3.00s > target 1s (burst)")


def test_bounds_are_enforced_first():
    assert decide([], spec(min_replicas=2), 1, 0) == Decision(2, "1 replicas is outside 2..10")
    assert decide([], spec(), 12, 0).replicas == 10
    assert decide([], spec(), 3, 0) == Decision(3, "no metrics yet")


def test_recent_change_blocks_scale_down_across_a_restart():
    # After an operator restart the history is short, but the last change (from status) still counts.
    quiet = [Sample(time=t, ready=4, queue_depth=0) for t in range(0, 121, 5)]
    assert decide(quiet, spec(), 4, 120, last_change=100).replicas == 4
    assert decide(quiet, spec(), 4, 120, last_change=30).replicas == 2


# The metrics the policy reads -----------------------------------------------------------------------------------------


def engine_metrics_text(waiting: int, running: int, ttfts: list[float], finished: int) -> str:
    """What a real kaon engine serves on /metrics (its own Metrics class)."""
    from kaon_runtime.engine.llm_engine import EngineStats
    from kaon_runtime.server.metrics import Metrics

    metrics = Metrics(lambda: EngineStats(num_running=running, num_waiting=waiting, kv_cache_usage=0.25,
                                          prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0,
                                          prompt_tokens=0, generation_tokens=0))
    for value in ttfts:
        metrics.ttft.observe(value)
    for _ in range(finished):
        metrics.requests.labels(finish_reason="stop").inc()
    return metrics.render().decode()


def test_parse_reads_the_engines_own_exposition():
    parsed = scraper.parse(engine_metrics_text(waiting=7, running=3, ttfts=[0.02] * 98 + [4.0, 4.0], finished=100))
    assert (parsed.waiting, parsed.running, parsed.kv_cache_usage, parsed.requests_total) == (7, 3, 0.25, 100)
    ttft = parsed.latency_buckets["ttft"]
    assert ttft[-1] == (math.inf, 100) and dict(ttft)[0.025] == 98
    p99 = scraper.quantile(ttft, 0.99)
    assert 2.5 < p99 <= 5.0  # the two slow requests sit in the (2.5, 5] bucket
    assert scraper.quantile(parsed.latency_buckets["e2e"], 0.99) is None  # no observations


def test_window_quantile_from_bucket_deltas_and_restarts():
    before = scraper.parse(engine_metrics_text(0, 0, [5.0] * 50, 50)).latency_buckets["ttft"]
    after = scraper.parse(engine_metrics_text(0, 0, [5.0] * 50 + [0.01] * 100, 150)).latency_buckets["ttft"]
    window = scraper.bucket_delta(after, before)
    assert window[-1][1] == 100
    assert scraper.quantile(window, 0.99) <= 0.01  # the old slow requests are outside the window
    restarted = scraper.parse(engine_metrics_text(0, 0, [0.3] * 3, 3)).latency_buckets["ttft"]
    assert scraper.bucket_delta(restarted, after) == restarted
    assert scraper.add_buckets(window, restarted)[-1] == (math.inf, 103)


def router_metrics_text(namespace: str, name: str, held: int) -> str:
    """What a real kaon router serves on /metrics while it holds requests for a service without pods."""
    from kaon_operator.router.endpoints import EndpointTable, ServiceKey
    from kaon_operator.router.metrics import RouterMetrics

    table = EndpointTable()
    table.apply_service("ADDED", {"metadata": {"namespace": namespace, "name": name, "creationTimestamp":
                                               "2026-01-01T00:00:00Z"}, "spec": {"model": {"uri": "builtin://x"}}})
    return RouterMetrics(table, {}, lambda: {ServiceKey(namespace, name): held}).render().decode()


def test_router_held_requests_parse_from_the_routers_own_exposition():
    text = router_metrics_text("team-a", "llama", 3)
    assert scraper.parse_router_held(text) == {("team-a", "llama"): 3.0}


def test_autoscaler_ticks_close_together_share_one_scrape_of_the_routers(monkeypatch):
    import asyncio

    from aiohttp import web

    from kaon_operator import handlers, status as pod_status

    async def scenario():
        hits = []

        async def metrics(request):
            hits.append(request.path)
            await asyncio.sleep(0.05)  # slow enough that the ticks overlap
            return web.Response(text='kaon_router_held_requests{namespace="ns",inferenceservice="a"} 2\n')

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        router = pod_status.PodSummary(name="router-0", ready=True, ip="127.0.0.1")
        state = handlers.State(kube=None)
        try:
            together = await asyncio.gather(*(handlers._router_held(state, [(router, port)]) for _ in range(5)))
            monkeypatch.setattr(handlers, "ROUTER_SCRAPE_REUSE_SECONDS", 0.0)
            later = await handlers._router_held(state, [(router, port)])
        finally:
            await state.http.close()
            await runner.cleanup()
        return hits, together, later

    hits, together, later = asyncio.run(scenario())
    assert len(hits) == 2  # five services' ticks at once, then one after the reuse window
    assert all(held == {("ns", "a"): 2.0} for held in together) and later == together[0]
