"""The physics of bench/autoscale_sim.py: what its verdicts on autoscaling rest on.

Short traces with a made-up engine (seconds of wall time); no timing assertions.
"""
from __future__ import annotations

import argparse
import heapq
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import autoscale_sim as sim
from autosim import oracle

# 20 ms a step, 2 ms per decoding sequence, 0.1 ms per prompt token; 8 sequences at most.
MODEL = sim.EngineModel(a=0.02, b=0.002, c=0.0001, cold_start_s=10.0, max_num_seqs=8, max_num_batched_tokens=256)
WORKLOAD = sim.Workload(prompt=(32, 128), output=(8, 32))


def poisson(rate: float, seconds: float, seed: int = 0) -> list[tuple[float, int, int]]:
    trace = sim.Trace("t", seconds, lambda t: rate)
    return sim.arrivals_for(trace, WORKLOAD, seed)


def fixed(arrivals, replicas: int, seconds: float, **kw) -> sim.Run:
    return sim.simulate(arrivals, seconds, MODEL, sim.Schedule([replicas] * 1000), replicas, **kw)


def test_one_request_alone_costs_its_steps():
    run = fixed([(1.0, 100, 5)], 1, 10)
    req = run.requests[0]
    assert req.ttft() == pytest.approx(MODEL.a + MODEL.c * 100)  # one prefill step, nothing queued
    assert req.done - req.first_token == pytest.approx(4 * (MODEL.a + MODEL.b))  # four decode steps of batch 1


def test_a_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    run = fixed([(0.0, 600, 1)], 1, 10)  # 256 + 256 + 88 tokens
    assert run.requests[0].ttft() == pytest.approx(3 * MODEL.a + MODEL.c * 600)


def test_the_batch_is_capped_and_the_rest_queue_fifo():
    burst = [(0.0, 64, 50) for _ in range(20)]
    run = fixed(burst, 1, 60)
    ttfts = [r.ttft() for r in run.requests]
    assert ttfts == sorted(ttfts)  # first come, first served
    # The 9th request cannot start before one of the first 8 (50 tokens each) is done.
    assert ttfts[8] > 40 * (MODEL.a + MODEL.b * 8)
    assert max(ttfts[:8]) < 1.0


def test_a_queue_builds_only_when_the_offered_load_exceeds_capacity():
    cap = sim.capacity(MODEL, WORKLOAD)
    light = fixed(poisson(0.5 * cap, 300), 1, 300)
    heavy = fixed(poisson(1.5 * cap, 300), 1, 300)
    late = [r.ttft() for r in heavy.requests if r.arrival > 240]
    early = [r.ttft() for r in heavy.requests if r.arrival < 10]
    assert max(r.ttft() for r in light.requests) < 1.0
    assert sum(late) / len(late) > 10 * sum(early) / len(early)  # TTFT grows with the backlog
    assert sum(late) / len(late) > 20.0


def test_two_replicas_share_the_load_and_no_request_is_lost():
    cap = sim.capacity(MODEL, WORKLOAD)
    arrivals = poisson(1.5 * cap, 300)
    run = fixed(arrivals, 2, 300)
    assert len(run.requests) == len(arrivals)
    assert all(r.done is not None and not r.cut and not r.failed for r in run.requests)
    assert max(r.ttft() for r in run.requests) < 2.0  # 75% of two replicas' capacity: no lasting queue
    assert run.replica_hours() == pytest.approx(2 * 300 / 3600)


def test_requests_still_running_after_the_drain_are_cut_and_counted():
    long = [(0.0, 32, 1000) for _ in range(6)]  # ~1000 steps each: far longer than the drain
    class Down(sim.Policy):
        period = 5.0

        def decide(self, cluster):
            return 1

    cut = sim.simulate(long, 30, MODEL, Down(), 2, drain_s=1.0)
    kept = sim.simulate(long, 30, MODEL, Down(), 2, drain_s=10_000.0)
    assert cut.cut == 3  # the newest replica had 3 of the 6 (least connections) when removed
    assert sum(r.cut for r in cut.requests) == 3
    assert kept.cut == 0 and all(r.done is not None for r in kept.requests)


def test_requests_are_held_until_a_cold_replica_is_ready():
    class FromZero(sim.Policy):
        period = 1.0

        def decide(self, cluster):
            return 1 if cluster.held or cluster.active else 0

    run = sim.simulate([(1.0, 64, 4), (1.5, 64, 4)], 60, MODEL, FromZero(), 0)
    # Held from 1.0 s, a replica asked for at the 2 s tick, ready 10 s later.
    assert run.requests[0].ttft() == pytest.approx(12.0 - 1.0 + MODEL.a + MODEL.b * 0 + MODEL.c * 128, abs=0.05)
    held_too_long = sim.simulate([(1.0, 64, 4)], 60, MODEL, sim.Schedule([0]), 0, hold_timeout_s=5.0)
    assert held_too_long.requests[0].failed


def test_the_scrape_builds_the_operators_sample():
    cluster = sim.Cluster(MODEL, 0.0, 30.0, 600.0)
    cluster.set_replicas(2)
    state = sim.Scrape(0.0, random.Random(0))
    for _ in range(12):
        cluster.route(sim.Request(0.0, 64, 3))
    sample = cluster.scrape(state)
    assert (sample.ready, sample.answered, sample.running + sample.waiting) == (2, 2, 12.0)
    assert sample.running == 2  # the first request at each replica is in its first step, the rest queue
    assert sample.finished == 0 and sample.latency[-1] == (float("inf"), 0.0)
    while cluster.events:  # run the engines dry
        at, _, kind, what = heapq.heappop(cluster.events)
        cluster.now = at
        if kind == "step":
            cluster.step_done(what)
    sample = cluster.scrape(state)
    assert sample.finished == 12 and sample.latency[-1][1] == 12.0 and sample.running == 0
    assert [le for le, _ in sample.latency][:-1] == list(sim.BUCKETS)
    assert cluster.scrape(state).finished == 0  # deltas, not lifetime counts


def test_scrape_failures_make_kaon_hold():
    arrivals = poisson(3 * sim.capacity(MODEL, WORKLOAD), 200)
    spec = sim.AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=4)
    blind = sim.Kaon(spec, MODEL.max_num_seqs, sim.Scrape(1.0, random.Random(0)))
    seeing = sim.Kaon(spec, MODEL.max_num_seqs, sim.Scrape(0.0, random.Random(0)))
    assert sim.simulate(arrivals, 200, MODEL, blind, 1).changes == 0  # no pod answers: hold, never guess
    assert sim.simulate(arrivals, 200, MODEL, seeing, 1).changes > 0  # the same overload, seen: scale up


def test_the_oracle_finds_the_replicas_a_minute_needs():
    cap = sim.capacity(MODEL, WORKLOAD)
    arrivals = poisson(2.5 * cap, 180)
    schedule = sim.oracle_schedule(arrivals, 180, MODEL, WORKLOAD, target=1.0, min_replicas=1)
    assert all(n >= 3 for n in schedule[1:])  # 2.5 replicas of work cannot fit 2
    run = sim.simulate(arrivals, 180, MODEL, sim.Schedule(schedule), schedule[0], cold_start_s=0.0)
    assert run.attainment(1.0) >= 0.98


def test_the_oracle_cache_returns_the_schedule_it_kept_and_a_new_trace_is_computed(tmp_path, monkeypatch):
    arrivals = poisson(1.5 * sim.capacity(MODEL, WORKLOAD), 120)
    computed = []
    real = sim.oracle_schedule
    monkeypatch.setattr(oracle, "oracle_schedule", lambda *a, **kw: computed.append(1) or real(*a, **kw))
    first = sim.cached_oracle_schedule(tmp_path, arrivals, 120, MODEL, WORKLOAD, 1.0, 1)
    again = sim.cached_oracle_schedule(tmp_path, arrivals, 120, MODEL, WORKLOAD, 1.0, 1)
    assert again == first == real(arrivals, 120, MODEL, WORKLOAD, 1.0, 1) and len(computed) == 1
    sim.cached_oracle_schedule(tmp_path, arrivals[:-1], 120, MODEL, WORKLOAD, 1.0, 1)  # another trace: not the kept one
    assert len(computed) == 2


def test_the_oracle_cache_key_hashes_every_simulator_module_the_oracle_runs_and_no_policy():
    """The key must change with any code the oracle's schedule depends on (else a stale schedule is reused) and
    must not change with a policy's (else every policy edit recomputes minutes of oracle): trace which of the
    simulator's files an oracle (and the capacity it starts from) executes."""
    package = Path(oracle.__file__).parent
    ran: set[str] = set()

    def tracer(frame, event, arg):
        path = Path(frame.f_code.co_filename)
        if path.parent == package:
            ran.add(path.name)
        return None

    arrivals = poisson(1.5 * sim.capacity(MODEL, WORKLOAD), 120)
    sys.setprofile(tracer)
    try:
        oracle.oracle_schedule(arrivals, 120, MODEL, WORKLOAD, 1.0, 1)
    finally:
        sys.setprofile(None)
    hashed = {Path(m.__file__).name for m in (*oracle.ORACLE_MODULES, oracle)}
    assert {"engine.py", "cluster.py", "simulation.py", "measure.py", "oracle.py"} <= ran
    assert ran <= hashed, f"the oracle runs {sorted(ran - hashed)} but its cache key does not hash them"
    assert not hashed & {"policies.py", "run.py", "report.py", "cli.py"}
    key = oracle.oracle_key(arrivals, 120, MODEL, WORKLOAD, 1.0, 1)
    assert key == oracle.oracle_key(arrivals, 120, MODEL, WORKLOAD, 1.0, 1)
    assert key != oracle.oracle_key(arrivals, 120, MODEL, WORKLOAD, 2.0, 1)


def test_the_dwell_oracle_holds_the_most_any_minute_of_its_block_needs():
    assert sim.dwell_schedule([1, 3, 2, 2, 1, 1, 1, 4], 5) == [3, 3, 3, 3, 3, 4, 4, 4]


def test_a_trace_can_change_its_length_mix_at_a_constant_rate():
    long = sim.Workload(prompt=(400, 500))
    trace = sim.Trace("t", 200, lambda t: 2.0, workload=lambda t: long if t >= 100 else WORKLOAD)
    arrivals = sim.arrivals_for(trace, WORKLOAD, 0)
    assert all(p <= 128 for t, p, _ in arrivals if t < 100) and all(p >= 400 for t, p, _ in arrivals if t >= 100)


def test_the_scrape_counts_tokens_as_the_engine_does():
    cluster = sim.Cluster(MODEL, 0.0, 30.0, 600.0)
    cluster.set_replicas(1)
    state = sim.Scrape(0.0, random.Random(0))
    for _ in range(3):
        cluster.route(sim.Request(0.0, 64, 5))
    assert cluster.scrape(state).prompt_tokens == 192  # counted when accepted
    while cluster.events:
        at, _, kind, what = heapq.heappop(cluster.events)
        cluster.now = at
        if kind == "step":
            cluster.step_done(what)
    sample = cluster.scrape(state)
    assert sample.output_tokens == 15 and sample.finished == 3
    assert sample.finished_output_tokens == 15  # the lengths of the requests that finished


def test_the_predictive_policy_scales_up_on_longer_prompts_at_the_same_rate():
    long = sim.Workload(prompt=(512, 768), output=(8, 32))
    cap = sim.capacity(MODEL, WORKLOAD)
    trace = sim.Trace("t", 600, lambda t: 1.5 * cap, workload=lambda t: long if t >= 300 else WORKLOAD)
    arrivals = sim.arrivals_for(trace, WORKLOAD, 0)
    spec = sim.AutoscalingSpec(enabled=True, min_replicas=1, max_replicas=8, target_p99_latency_seconds=1.0,
                               scale_down_stabilization_seconds=120)
    policy = sim.Kaon(spec, MODEL.max_num_seqs, sim.Scrape(0.0, random.Random(0)), model=MODEL.perf_model())
    run = sim.simulate(arrivals, 600, MODEL, policy, 2)
    before = max(n for t, n in run.replica_log if t < 300)
    after = max(n for t, n in run.replica_log if t >= 300)
    assert policy.name == "kaon-predictive" and after > before


def test_seeds_pool_into_one_row_and_kaon_meets_the_cheapest_hpa_at_its_slo():
    def row(policy, seed, slo, hours, requests=1000):
        return {"trace": "t", "policy": policy, "slo_attainment": slo, "replica_hours": hours, "requests": requests,
                "changes_per_hour": 2.0, "cut_requests": 0, "failed_held": 0, "p99_ttft_s": 3.0 + seed,
                "replica_hours_vs_oracle": None, "replica_hours_vs_dwell_oracle": None}

    rows = [row("kaon-predictive", 0, 0.99, 4.0), row("kaon-predictive", 1, 0.98, 5.0, 3000),
            row("hpa", 0, 0.97, 3.0), row("hpa", 1, 0.97, 3.0, 3000),
            row("hpa-x0.8", 0, 0.99, 5.0), row("hpa-x0.8", 1, 0.99, 5.0, 3000),
            row("hpa-x0.5", 0, 1.0, 7.0), row("hpa-x0.5", 1, 1.0, 7.0, 3000),
            row("oracle", 0, 1.0, 2.0), row("oracle", 1, 1.0, 2.0, 3000)]
    pooled = {r["policy"]: r for r in sim.pooled(rows)}
    kaon = pooled["kaon-predictive"]
    assert kaon["slo_attainment"] == 0.9825 and kaon["requests"] == 4000  # misses summed, not rates averaged
    assert kaon["replica_hours"] == 9.0 and kaon["replica_hours_vs_oracle"] == 2.25 and kaon["p99_ttft_s"] == 4.0
    # The default HPA is cheaper but worse; the cheapest setting at kaon's SLO or better is x0.8.
    verdict = sim.iso_slo(list(pooled.values()))[0]
    assert verdict["hpa_setting"] == "hpa-x0.8" and verdict["below_hpa"]
    assert not sim.iso_slo([*list(pooled.values())[:1], {**pooled["hpa-x0.8"], "replica_hours": 8.0}])[0]["below_hpa"]


def test_a_standby_wakes_in_its_wake_time_a_new_one_starts_behind_and_its_cost_is_counted():
    """Issue 53: the simulator's standby replicas (what kaon-standby is judged with)."""
    class FromZero(sim.Policy):
        period = 1.0

        def decide(self, cluster):
            return 2 if cluster.held or cluster.active else 0

    arrivals = [(1.0, 64, 4), (1.5, 64, 4), (30.0, 64, 4)]
    run = sim.simulate(arrivals, 60, MODEL, FromZero(), 0, standby=1, wake_s=0.5, standby_cost=0.25)
    # Asked for at the 2 s tick: the standby is ready 0.5 s later, not after the 10 s cold start.
    assert run.requests[0].ttft() == pytest.approx(2.5 - 1.0 + MODEL.a + MODEL.c * 64, abs=0.05)
    cold = sim.simulate(arrivals, 60, MODEL, FromZero(), 0)
    assert cold.requests[0].ttft() > 10.0
    # One standby the whole minute, counted at a quarter of a replica; the second replica woke the standby
    # still loading behind the first (counted as that replica from then on); the one behind it loaded for
    # the 10 s cold start, counted in full: a pod loading holds its device whatever a sleeping one costs.
    assert run.standby_hours() == pytest.approx(60 / 3600)
    assert run.standby_loading_hours() == pytest.approx(10 / 3600)
    assert run.replica_hours() == pytest.approx(cold.replica_hours() + 0.25 * 60 / 3600 + 0.75 * 10 / 3600)
    # The standby woken was replaced by one starting behind it: the next scale-up finds it loaded.
    cluster = sim.Cluster(MODEL, 10.0, 30.0, 600.0)
    cluster.standby, cluster.wake_s = 1, 0.5
    cluster.fill_standby(0.0)
    cluster.set_replicas(1)
    assert cluster.active[0].ready_at == 0.5 and cluster.sleepers == [10.0]
    cluster.now = 4.0
    cluster.set_replicas(2)  # the standby behind is still loading: ready when it has loaded, then woken
    assert cluster.active[1].ready_at == pytest.approx(10.5)


def test_the_routers_pressure_wakes_a_standby_after_the_read_and_its_latency_and_a_lost_read_does_nothing():
    """Issue 53: kaon-standby's fast signal as the simulator models it: the router's pressure is read every
    interval, acted on a latency later by the operator's own decision (router_pressure.decide), and a read
    may be lost; it fires only when the router holds (or queues) requests."""
    spec = sim.AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=4, scale_to_zero_idle_seconds=120, standby=1)

    class Still(sim.Kaon):
        """The regular policy never moves (its tick is past the trace): only the pressure can wake."""
        period = 1000.0

        def decide(self, cluster):
            return len(cluster.active)

    def poked(arrivals, loss: float) -> sim.Run:
        policy = Still(spec, MODEL.max_num_seqs, sim.Scrape(0.0, random.Random(0)))
        return sim.simulate(arrivals, 60, MODEL, policy, 0, standby=1, wake_s=0.5,
                            poke=sim.Poke(interval_s=1.0, latency_s=0.5, loss=loss, rng=random.Random(0)))

    run = poked([(1.2, 64, 4)], loss=0.0)
    # Held at 1.2, seen at the 2 s read, acted on at 2.5, the standby awake at 3.0.
    assert run.requests[0].ttft() == pytest.approx(3.0 - 1.2 + MODEL.a + MODEL.c * 64, abs=0.01)
    assert run.changes == 1
    lost = poked([(1.2, 64, 4)], loss=1.0)  # every read lost: served only when the trace is over
    assert lost.requests[0].ttft() > 55 and lost.changes == 0
    idle = poked([], loss=0.0)  # nothing held, nothing queued: no wake
    assert idle.changes == 0 and idle.pod_log[-1][1] == 0


def test_kaon_standby_goes_to_zero_after_its_own_idle_time_the_others_after_a_cold_starts_worth():
    """A return from zero with standbys is a wake: kaon-standby's user writes a short scaleToZeroIdleSeconds
    (Config.standby_idle_s); with minReplicas 1 there is nothing to set."""
    config = sim.Config(MODEL, WORKLOAD, standby_idle_s=30)
    idle = sim.Trace("idle", 60.0, lambda t: 0.0, min_replicas=0)
    by_name = {p.name: p for p in sim.policies(config, idle, [0])}
    assert by_name["kaon-standby"].spec.scale_to_zero_idle_seconds == 30
    assert by_name["kaon-predictive"].spec.scale_to_zero_idle_seconds == 120
    busy = {p.name: p for p in sim.policies(config, sim.Trace("busy", 60.0, lambda t: 1.0), [1])}
    assert busy["kaon-standby"].spec.scale_to_zero_idle_seconds is None


class Stub(random.Random):
    """A Random whose uniform(lo, hi) returns lo + share x (hi - lo), the share taken in turn: draws made visible."""

    def __init__(self, *shares: float):
        super().__init__(0)
        self.shares, self.calls = list(shares), 0

    def uniform(self, a: float, b: float) -> float:
        share = self.shares[self.calls % len(self.shares)]
        self.calls += 1
        return a + share * (b - a)


def test_the_profiled_wake_draws_the_probe_per_pod_and_the_standby_round_once_per_scale_up_not_on_a_poke():
    """Issue 53, wake times from the profile: a woken standby serves after the standby loop's round (regular
    scale-ups only, one round for every standby it wakes), the engine's wake, its own readiness probe's phase
    and the routers' watch."""
    wake = sim.Wake(engine_s=0.2, probe_period_s=1.0, ready_to_router_s=0.1, round_s=2.0, rng=Stub(0.5, 0.25, 0.75))
    cluster = sim.Cluster(MODEL, 10.0, 30.0, 600.0)
    cluster.standby, cluster.wake_s = 3, wake
    cluster.fill_standby(0.0)
    cluster.now = 5.0
    cluster.set_replicas(2)  # regular: the round (0.5 x 2 s) once, then each pod's probe phase (0.25 s, 0.75 s)
    assert [r.ready_at for r in cluster.active] == pytest.approx([5.0 + 1.0 + 0.2 + 0.25 + 0.1,
                                                                  5.0 + 1.0 + 0.2 + 0.75 + 0.1])
    cluster.set_replicas(3, poked=True)  # the pressure loop wakes in the same breath: no round, a probe phase
    assert cluster.active[2].ready_at == pytest.approx(5.0 + 0.2 + 0.5 + 0.1)
    assert wake.rng.calls == 4
    assert wake.mean() == pytest.approx(0.2 + 0.5 + 0.1 + 1.0) and wake.mean(poked=True) == pytest.approx(0.8)
    # A constant wake (--wake-s, what every standby figure before this one used) draws nothing.
    constant = sim.Wake(3.0, rng=Stub(0.5))
    assert constant.seconds(constant.round_delay(poked=False)) == 3.0 and constant.rng.calls == 0


def test_the_profiled_wake_is_the_default_and_its_periods_are_the_operators():
    from kaon_operator.autoscaling import standby, standby_sync
    assert sim.PROFILED.probe_period_s == standby.STANDBY_READINESS_PERIOD_SECONDS
    assert sim.PROFILED.round_s == standby_sync.INTERVAL_SECONDS
    assert sim.Config(MODEL).wake == sim.PROFILED

    def wake(*argv: str) -> sim.Wake:
        parser = argparse.ArgumentParser()
        parser.add_argument("--wake-s", type=float)
        parser.add_argument("--engine-wake-s", type=float)
        return sim.wake_of(parser.parse_args(list(argv)))
    assert wake() == sim.PROFILED
    assert wake("--wake-s", "3") == sim.Wake(3.0)
    assert wake("--engine-wake-s", "1.5") == sim.Wake(1.5, sim.PROFILED.probe_period_s,
                                                       sim.PROFILED.ready_to_router_s, sim.PROFILED.round_s)
    # kaon-standby's predictive policy is told a wake's mean (a regular scale-up's) as its start time.
    config = sim.Config(MODEL, WORKLOAD, wake=sim.Wake(1.5, round_s=2.0))
    standby_policy = {p.name: p for p in sim.policies(config, sim.Trace("t", 60.0, lambda t: 1.0), [1])}["kaon-standby"]
    assert standby_policy.model.cold_start_seconds == pytest.approx(2.5)


def test_a_wake_the_routers_pressure_orders_skips_the_standby_loops_round():
    """The pressure loop wakes the standbys in its own breath (pressure_sync.py calls the standby loop's tick):
    only its read and latency come before the wake, never the standby loop's next round."""
    spec = sim.AutoscalingSpec(enabled=True, min_replicas=0, max_replicas=4, scale_to_zero_idle_seconds=120, standby=1)

    class Still(sim.Kaon):
        period = 1000.0

        def decide(self, cluster):
            return len(cluster.active)

    policy = Still(spec, MODEL.max_num_seqs, sim.Scrape(0.0, random.Random(0)))
    run = sim.simulate([(1.2, 64, 4)], 60, MODEL, policy, 0, standby=1,
                       wake_s=sim.Wake(0.5, round_s=2.0, rng=Stub(1.0)),
                       poke=sim.Poke(interval_s=1.0, latency_s=0.5, loss=0.0, rng=random.Random(0)))
    # Held at 1.2, read at 2, acted on at 2.5, awake at 3.0: the round's 2 s (the stub draws its whole) not added.
    assert run.requests[0].ttft() == pytest.approx(3.0 - 1.2 + MODEL.a + MODEL.c * 64, abs=0.01)
