"""The autoscaling policy on simulated traces, and the metrics it reads from engine pods.

The simulation models capacity honestly: each ready replica runs at most `maxNumSeqs`
requests and the rest wait, so a queue grows only when capacity is short; a new replica
is ready only after its cold start; a scrape can fail. Demand is the number of requests
in flight that clients keep open (a closed loop), which is what concurrency measures.
"""
from __future__ import annotations

import math
import random

import pytest

from kaon_operator import api
from kaon_operator.autoscaling import autoscale_loop, histogram, scraper
from kaon_operator.autoscaling.autoscaler import Decision, Sample, concurrency_target, decide
from support.metrics_text import engine_metrics_text, router_metrics_text

TICK = 5.0
SEQS = 64  # engine.maxNumSeqs: with the default targetUtilization 0.7 the target is 44.8 per replica
SERVICE_SECONDS = 10.0  # how long one request takes: finished requests per tick = running x TICK / this


def spec(**kw) -> api.AutoscalingSpec:
    base = {"enabled": True, "min_replicas": 1, "max_replicas": 10, "scale_up_window_seconds": 30,
            "scale_down_stabilization_seconds": 300, "max_step": 2}
    return api.AutoscalingSpec(**{**base, **kw})


def simulate(demand, s: api.AutoscalingSpec, seconds: float, start: int = 1, *, cold_start: float = 0.0,
             answers=lambda t, ready: ready, latency=lambda t, waiting, running, ready: ()):
    """Run the policy every TICK over a cluster of replicas; return [(time, replicas, decision)]."""
    pods = [0.0] * start  # when each pod is (or becomes) ready
    history, timeline, last_change, t = [], [], None, 0.0
    while t <= seconds:
        ready = sum(at <= t for at in pods)
        offered = demand(t)
        running = min(offered, ready * SEQS)
        waiting = offered - running if ready else 0.0
        held = offered if not ready else 0.0
        history.append(Sample(time=t, ready=ready, answered=answers(t, ready), waiting=waiting, running=running,
                              starting=len(pods) - ready, finished=running * TICK / SERVICE_SECONDS,
                              latency=latency(t, waiting, running, ready), held_by_router=held))
        decision = decide(history, s, len(pods), t, last_change, max_num_seqs=SEQS)
        if decision.replicas != len(pods):
            last_change = t
        if decision.replicas > len(pods):
            pods += [t + cold_start] * (decision.replicas - len(pods))
        elif decision.replicas < len(pods):
            pods = sorted(pods)[:decision.replicas]  # not-ready pods go first, as a ReplicaSet does
        timeline.append((t, decision.replicas, decision))
        t += TICK
    return timeline


def replicas_at(timeline, t: float) -> int:
    return [r for when, r, _ in timeline if when <= t][-1]


def changes(timeline, start: int | None = None) -> list[tuple[float, int]]:
    out, prev = [], start if start is not None else timeline[0][1]
    for when, r, _ in timeline:
        if r != prev:
            out.append((when, r))
            prev = r
    return out


def noisy(level: float, spread: float, seed: int = 7):
    rng, memo = random.Random(seed), {}
    return lambda t: memo.setdefault(t, max(0.0, rng.gauss(level, spread)))


def test_default_target_is_a_share_of_the_engines_batch():
    assert concurrency_target(spec(), SEQS) == pytest.approx(44.8)
    assert concurrency_target(spec(target_concurrency_per_replica=10), SEQS) == 10


# Steady load ------------------------------------------------------------------------------------------------------


def test_steady_load_of_busy_replicas_that_do_not_queue_never_moves_replicas():
    # The case: 150 in flight, maxNumSeqs 64. Counting only waiting requests made the old
    # policy see idle replicas and go 3 -> 1 -> 3 every ~305 s.
    timeline = simulate(lambda t: 150, spec(), 2 * 3600, start=3)
    assert changes(timeline) == [(30, 4)], changes(timeline)  # 150 / 44.8 -> 4 after one window, then never again


@pytest.mark.parametrize("level", [20, 60, 100, 150, 250])
def test_noisy_steady_load_settles_and_stays(level):
    timeline = simulate(noisy(level, 0.1 * level), spec(), 2 * 3600, start=1)
    moves = changes(timeline)
    assert all(when < 600 for when, _ in moves), moves  # settled within 10 minutes, then still for 1h50
    assert len(moves) <= 2, moves
    final = timeline[-1][1]
    assert math.ceil(level / 44.8) <= final <= math.ceil(level / 44.8) + 1


# Steps, bursts, ramps -----------------------------------------------------------------------------------------------


def test_a_burst_reacts_at_once_up_to_max_step():
    timeline = simulate(lambda t: 30 if t < 600 else 300, spec(max_step=3), 900)
    moves = changes(timeline)
    assert moves[0] == (600, 4), moves  # 300 >= 2 x 44.8: the first tick after the burst, +max_step
    assert replicas_at(timeline, 900) == 7  # ceil(300 / 44.8)
    assert timeline[120][2].reason.endswith("(burst)")


def test_a_moderate_step_up_reacts_within_the_window():
    timeline = simulate(lambda t: 40 if t < 600 else 70, spec(), 900)  # 70 / 44.8 = 1.56: not a burst
    moves = changes(timeline)
    assert len(moves) == 1 and 600 < moves[0][0] <= 600 + 30 and moves[0][1] == 2, moves


def test_a_step_down_waits_for_the_stabilization_window_and_never_cuts_below_the_peak():
    timeline = simulate(lambda t: 200 if t < 1200 else 60, spec(max_step=5), 2400, start=5)
    moves = changes(timeline)
    assert moves == [(1500, 2)], moves  # 300 s after the drop; 60 / (44.8 x 0.9) -> 2
    assert "peak concurrency 60" in timeline[300][2].reason


def test_slow_ramp_follows_demand_without_overshoot_or_a_step_back():
    timeline = simulate(lambda t: 10 + 250 * min(t, 3600) / 3600, spec(), 4000)
    rs = [r for _, r, _ in timeline]
    assert rs == sorted(rs), "a ramp up never scales down"
    for when, r, _ in timeline:
        assert r <= math.ceil((10 + 250 * min(when, 3600) / 3600) / 44.8) + 1, (when, r)
    assert replicas_at(timeline, 4000) == 6


def test_queue_at_the_ready_replicas_adds_capacity_even_when_the_concurrency_target_is_too_high():
    # A target above what a replica can run (64): concurrency alone never asks for more, the queue does.
    timeline = simulate(lambda t: 150, spec(target_concurrency_per_replica=150), 300)
    assert replicas_at(timeline, 300) >= 2
    assert any("queue depth" in d.reason for _, _, d in timeline)


def test_replicas_that_are_still_starting_are_not_asked_for_again():
    timeline = simulate(lambda t: 30 if t < 100 else 120, spec(), 900, cold_start=300)
    # 120 / 44.8 -> 3 at once; the queue at the one ready replica during the 300 s cold start
    # must not add more on top.
    assert max(r for _, r, _ in timeline) == 3, changes(timeline)


def test_capped_at_max_replicas_is_reported():
    timeline = simulate(lambda t: 500, spec(max_replicas=3, max_step=5), 60)
    final = timeline[-1][2]
    assert final.replicas == 3 and final.capped_from == math.ceil(500 / 44.8)


# Latency ------------------------------------------------------------------------------------------------------------

SLOW = ((0.5, 0.0), (1.0, 0.0), (2.5, 20.0), (5.0, 20.0), (math.inf, 20.0))  # 20 requests in (1, 2.5]
FAST = ((0.5, 20.0), (1.0, 20.0), (2.5, 20.0), (5.0, 20.0), (math.inf, 20.0))


def test_a_p99_target_scales_up_when_concurrency_and_queue_would_not():
    s = spec(target_p99_latency_seconds=1.0)
    # From t=60 each replica is slow above 20 requests in flight (long prompts, say): far
    # below the concurrency target of 44.8, and nothing waits.
    slow_above_20 = lambda t, waiting, running, ready: SLOW if t >= 60 and running / ready > 20 else FAST  # noqa: E731
    timeline = simulate(lambda t: 30, s, 600, latency=slow_above_20)
    # The first slow tick (20 requests) is already a P99 over target: 2 replicas carry 15 each,
    # fast again, and it stays there.
    assert changes(timeline) == [(60, 2)], changes(timeline)
    assert timeline[12][2].reason == "P99 ttft 2.42s > target 1s (20 of 100 requests over)"
    # Without the target, the same trace holds still.
    assert changes(simulate(lambda t: 30, spec(), 600, latency=slow_above_20)) == []


def test_a_few_slow_requests_are_not_a_p99():
    few = ((0.5, 0.0), (1.0, 0.0), (2.5, 1.0), (5.0, 1.0), (math.inf, 1.0))  # 1 request per tick, 6 a window
    s = spec(target_p99_latency_seconds=1.0)
    assert changes(simulate(lambda t: 30, s, 120, latency=lambda t, w, r, ready: few)) == []


def test_high_p99_blocks_scale_down():
    s = spec(target_p99_latency_seconds=1.0, scale_down_stabilization_seconds=60)
    timeline = simulate(lambda t: 30, s, 600, start=3, latency=lambda t, w, r, ready: SLOW)
    # 30 in flight fits one replica, but P99 stays over target: it never removes one.
    assert all(r >= 3 for _, r, _ in timeline)


# Failing safe -------------------------------------------------------------------------------------------------------


def test_a_failed_scrape_holds_replicas_and_says_so():
    # The case: six busy replicas, minReplicas 0, the scrapes fail (a NetworkPolicy).
    s = spec(min_replicas=0, scale_to_zero_idle_seconds=600)
    timeline = simulate(lambda t: 250, s, 1800, start=6, answers=lambda t, ready: ready if t < 60 else 0)
    assert all(r == 6 for _, r, _ in timeline), changes(timeline)
    last = timeline[-1][2]
    assert last.metrics_missing == "6 of 6 ready replicas did not answer the scrape"


def test_frequent_partial_scrapes_hold_but_a_rare_miss_does_not_block_scale_down():
    s = spec(scale_down_stabilization_seconds=60)
    half_every_other = lambda t, ready: ready // 2 if int(t / TICK) % 2 else ready  # noqa: E731
    timeline = simulate(lambda t: 10, s, 600, start=4, answers=half_every_other)
    assert all(r == 4 for _, r, _ in timeline), changes(timeline)
    # One pod of four missing every other scrape: those scrapes still count (the missing pod
    # assumed as loaded as the others), so it goes down to 2; there one of two is half: it holds.
    one_every_other = lambda t, ready: ready - 1 if int(t / TICK) % 2 else ready  # noqa: E731
    assert changes(simulate(lambda t: 10, s, 600, start=4, answers=one_every_other)) == [(60, 2)]
    one_in_twenty = lambda t, ready: ready - 1 if int(t / TICK) % 20 == 7 else ready  # noqa: E731
    timeline = simulate(lambda t: 10, s, 600, start=4, answers=one_in_twenty)
    assert changes(timeline) == [(60, 2), (90, 1)], changes(timeline)  # max_step 2, then a scale-up window


def test_router_unknown_at_zero_holds():
    s = spec(min_replicas=0, scale_to_zero_idle_seconds=60)
    d = decide([Sample(time=0, ready=0, held_by_router=None)], s, 0, 0)
    assert d.replicas == 0 and d.metrics_missing


# Zero ---------------------------------------------------------------------------------------------------------------


def test_idle_goes_to_zero_and_back_when_the_router_holds_requests():
    s = spec(min_replicas=0, scale_to_zero_idle_seconds=120, scale_down_stabilization_seconds=60)
    timeline = simulate(lambda t: 60 if t < 100 or t >= 600 else 0, s, 700, start=2)
    moves = changes(timeline)
    assert moves[:2] == [(160, 1), (280, 0)], moves  # down after the window, to zero after 120 s idle since
    assert moves[2] == (600, 2), moves  # 60 held at the router -> ceil(60 / 44.8)
    assert timeline[120][2].reason == "60 requests waiting at the router"


def test_never_back_to_zero_while_a_replica_is_still_starting():
    s = spec(min_replicas=0, scale_to_zero_idle_seconds=60)
    # One request arrives at t=0 and waits at the router for a replica with a 600 s cold start.
    timeline = simulate(lambda t: 1, s, 900, start=0, cold_start=600)
    assert changes(timeline, start=0) == [(0, 1)], changes(timeline, start=0)


# Bounds and restarts ------------------------------------------------------------------------------------------------


def test_bounds_are_enforced_first():
    assert decide([], spec(min_replicas=2), 1, 0) == Decision(2, "1 replicas is outside 2..10")
    assert decide([], spec(), 12, 0).replicas == 10
    assert decide([], spec(), 3, 0) == Decision(3, "no metrics yet")


def test_recent_change_blocks_scale_down_across_a_restart():
    # After an operator restart the history is short, but the last change (from status) still counts.
    s = spec(scale_down_stabilization_seconds=60)
    quiet = [Sample(time=t, ready=4, running=5) for t in range(0, 121, 5)]
    assert decide(quiet, s, 4, 120, last_change=100).replicas == 4
    assert decide(quiet, s, 4, 120, last_change=30).replicas == 2


# Baselines of cumulative counters -------------------------------------------------------------------------------------


def pod(finished: float, ttft: tuple = ()) -> scraper.PodMetrics:
    return scraper.PodMetrics(requests_total=finished, latency_buckets={"ttft": ttft})


def test_a_first_scrape_is_only_a_baseline_and_a_missed_scrape_keeps_it():
    lifetime = ((1.0, 0.0), (math.inf, 1000.0))  # 1000 slow requests before the operator started
    baselines, finished, latency = autoscale_loop.advance({}, {"a"}, {"a": pod(1000, lifetime)}, "ttft")
    assert finished == 0 and latency == ()  # not 1000 finished, not a P99 from the pod's whole life
    # "a" misses the next scrape: its baseline stays, so the one after covers both intervals.
    baselines, finished, _ = autoscale_loop.advance(baselines, {"a"}, {}, "ttft")
    assert finished == 0 and baselines["a"].finished == 1000
    baselines, finished, latency = autoscale_loop.advance(
        baselines, {"a"}, {"a": pod(1010, ((1.0, 10.0), (math.inf, 1010.0)))}, "ttft")
    assert finished == 10 and latency == ((1.0, 10.0), (math.inf, 10.0))


def test_a_restarted_engine_counts_from_zero_and_a_gone_pod_is_forgotten():
    baselines, _, _ = autoscale_loop.advance({}, {"a", "b"}, {"a": pod(500), "b": pod(7)}, "ttft")
    baselines, finished, _ = autoscale_loop.advance(baselines, {"a"}, {"a": pod(3)}, "ttft")
    assert finished == 3 and set(baselines) == {"a"}


# The metrics the policy reads -----------------------------------------------------------------------------------------


def test_parse_reads_the_engines_own_exposition():
    parsed = scraper.parse(engine_metrics_text(waiting=7, running=3, ttfts=[0.02] * 98 + [4.0, 4.0], finished=100))
    assert (parsed.waiting, parsed.running, parsed.kv_cache_usage, parsed.requests_total) == (7, 3, 0.25, 100)
    ttft = parsed.latency_buckets["ttft"]
    assert ttft[-1] == (math.inf, 100) and dict(ttft)[0.025] == 98
    p99 = histogram.quantile(ttft, 0.99)
    assert 2.5 < p99 <= 5.0  # the two slow requests sit in the (2.5, 5] bucket
    assert histogram.quantile(parsed.latency_buckets["e2e"], 0.99) is None  # no observations


def test_window_quantile_from_bucket_deltas_and_restarts():
    before = scraper.parse(engine_metrics_text(0, 0, [5.0] * 50, 50)).latency_buckets["ttft"]
    after = scraper.parse(engine_metrics_text(0, 0, [5.0] * 50 + [0.01] * 100, 150)).latency_buckets["ttft"]
    window = histogram.bucket_delta(after, before)
    assert window[-1][1] == 100
    assert histogram.quantile(window, 0.99) <= 0.01  # the old slow requests are outside the window
    restarted = scraper.parse(engine_metrics_text(0, 0, [0.3] * 3, 3)).latency_buckets["ttft"]
    assert histogram.bucket_delta(restarted, after) == restarted
    assert histogram.add_buckets(window, restarted)[-1] == (math.inf, 103)


def test_router_held_requests_parse_from_the_routers_own_exposition():
    text = router_metrics_text("team-a", "llama", 3)
    assert scraper.parse_router_held(text) == {("team-a", "llama"): 3.0}


class FakeKube:
    """The API client the loop needs: the router pods (at `ip`, answering on `router_port`), writes."""

    def __init__(self, router_port, ip="127.0.0.1"):
        self.router_port, self.ip, self.patches, self.replicas = router_port, ip, [], []

    def list_pods(self, namespace, selector):
        assert namespace == "kaon-system" and "component=router" in selector
        return [{"metadata": {"name": "router"}, "spec": {"containers": [{"ports": [
            {"name": "http", "containerPort": self.router_port}]}]},
                 "status": {"podIP": self.ip, "conditions": [{"type": "Ready", "status": "True"}]}}]

    def patch_status(self, namespace, name, patch, resource_version=None):
        self.patches.append((name, patch))
        return {"metadata": {"resourceVersion": "2"}}

    def patch_replicas(self, namespace, name, replicas, resource_version=None):
        self.replicas.append((name, replicas))


def autoscaled(name):
    return {"metadata": {"namespace": "ns", "name": name}, "spec": {
        "model": {"uri": "builtin://x"}, "replicas": 1,
        "autoscaling": {"enabled": True, "scaleUpWindowSeconds": 0}}}


async def serve_metrics(host, *texts):
    """One server per exposition text on `host`, each answering /metrics: (runners, ports, hits)."""
    from aiohttp import web

    runners, ports, hits = [], [], []
    for index, text in enumerate(texts):
        async def metrics(request, index=index, text=text):
            hits.append(index)
            return web.Response(text=text)

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, 0)
        await site.start()
        runners.append(runner)
        ports.append(site._server.sockets[0].getsockname()[1])
    return runners, ports, hits


async def one_tick(kube, caches, engine_port, monkeypatch):
    """One tick of the loop on a context over `kube` and `caches`: (MetricsAvailable per service, Events)."""
    from functools import partial

    import aiohttp

    from kaon_operator import urls
    from kaon_operator.config import AutoscaleSettings, OperatorConfig
    from kaon_operator.context import Context

    conditions, events = {}, []
    monkeypatch.setattr(autoscale_loop.status_sync, "metrics_changed",
                        lambda ctx, key, condition: conditions.__setitem__(key, condition))
    ctx = Context(OperatorConfig(autoscale=AutoscaleSettings(interval=1)), kube, caches)
    ctx.post = lambda body, ev: events.extend(ev)
    loop = autoscale_loop.AutoscaleLoop(ctx, url_of=partial(urls.engine_url, port=engine_port))

    loop.http = aiohttp.ClientSession()
    try:
        await loop.tick_all()
    finally:
        await loop.http.close()
    return conditions, events


async def tick_against(host, kube_at, caches, monkeypatch):
    """Serve a router's and an engine's /metrics on `host`, and tick once: (hits, kube, conditions, events).
    `kube_at(router_port)` makes the API client that lists the router pod."""
    router = 'kaon_router_held_requests{namespace="ns",inferenceservice="a"} 0\n'
    engine = engine_metrics_text(waiting=100, running=64, ttfts=[], finished=0)
    runners, (router_port, engine_port), hits = await serve_metrics(host, router, engine)
    kube = kube_at(router_port)
    try:
        conditions, events = await one_tick(kube, caches, engine_port, monkeypatch)
    finally:
        for runner in runners:
            await runner.cleanup()
    return hits, kube, conditions, events


def test_one_tick_scrapes_the_routers_once_for_every_service_and_fails_safe(monkeypatch):
    """The loop against real HTTP servers: two autoscaled services, one router, engines
    that answer, then an engine that does not."""
    import asyncio

    from kaon_operator.caches import Caches
    from kaon_operator.status.summaries import PodSummary

    pods = {("ns", "a"): [PodSummary(name="a-0", ip="127.0.0.1", ready=True)],
            ("ns", "b"): [PodSummary(name="b-0", ip="127.0.0.2", ready=True)]}  # b's engine never answers
    caches = Caches(inference_services={("ns", n): [autoscaled(n)] for n in "ab"}, engine_pods=pods)
    hits, kube, conditions, events = asyncio.run(tick_against("127.0.0.1", FakeKube, caches, monkeypatch))
    assert hits.count(0) == 1  # two services, one scrape of the routers
    assert kube.replicas == [("a", 3)]  # 164 in flight at a target of 44.8 -> 4, max step 2 -> 3
    assert conditions[("ns", "a")]["status"] == "True"
    assert conditions[("ns", "b")] == {"type": "MetricsAvailable", "status": "False", "reason": "ScrapeFailed",
                                       "message": "1 of 1 ready replicas did not answer the scrape; "
                                                  "no scale-down until they answer"}
    assert [e.reason for e in events] == ["Scaled"]


def test_the_loop_scrapes_engines_and_routers_at_ipv6_pod_ips(monkeypatch):
    """An IPv6-only cluster: pod IPs like fd00::1 go in brackets (http://[fd00::1]:8000), else
    no scrape reaches a pod and the autoscaler never sees a load."""
    import asyncio
    import socket

    from kaon_operator.caches import Caches
    from kaon_operator.status.summaries import PodSummary

    try:
        socket.socket(socket.AF_INET6).close()
        socket.getaddrinfo("::1", 0, socket.AF_INET6)
    except OSError:
        pytest.skip("no IPv6 loopback here")
    caches = Caches(inference_services={("ns", "a"): [autoscaled("a")]},
                    engine_pods={("ns", "a"): [PodSummary(name="a-0", ip="::1", ready=True)]})
    hits, kube, conditions, _ = asyncio.run(tick_against("::1", lambda port: FakeKube(port, ip="::1"), caches,
                                                         monkeypatch))
    assert sorted(hits) == [0, 1]  # the router and the engine were both reached
    assert conditions[("ns", "a")]["status"] == "True" and kube.replicas == [("a", 3)]

