"""The disaggregated fleet of bench/autoscale_disagg.py (issue 50): what its two-pool verdicts rest on.

A made-up engine, short traces (well under a second of wall time); no timing assertions.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))

import autoscale_disagg as dis
import autoscale_sim as sim

# 20 ms a step, 2 ms per decoding sequence, 0.1 ms per prompt token; 8 sequences, 256-token chunks.
MODEL = sim.EngineModel(a=0.02, b=0.002, c=0.0001, cold_start_s=10.0, max_num_seqs=8, max_num_batched_tokens=256)
MOVE = 0.001  # seconds per token of the last chunk's KV move


class Fixed:
    """A prefill policy that keeps the pool at n replicas."""
    period = 5.0

    def __init__(self, n: int):
        self.n = n

    def decide(self, prefill: dis.PrefillPool, decode: dis.DecodePool) -> int:
        return self.n


def run(arrivals, seconds: float, prefill: object, decode: int = 1, initial_prefill: int = 1, **kw) -> dis.Fleet:
    return dis.simulate_disagg(arrivals, seconds, MODEL, prefill, sim.Schedule([decode] * 1000),  # type: ignore[arg-type]
                               initial_prefill, decode, transfer_s_per_token=MOVE, **kw)


def test_one_request_goes_through_prefill_the_move_and_one_decode_step():
    fleet = run([(1.0, 100, 5)], 20, Fixed(1))
    req = fleet.requests[0]
    prefill = MODEL.a + MODEL.c * 99  # the prefill engine computes all but the last prompt token
    move = MOVE * 100
    first = MODEL.a + MODEL.c * 1  # the decode engine computes the last token and samples the first output
    assert req.ttft() == pytest.approx(prefill + move + first)
    assert dis.inter_token_latency(req) == pytest.approx(MODEL.a + MODEL.b)  # decode steps of batch 1


def test_a_prefill_pool_without_capacity_makes_ttft_grow_and_one_with_capacity_does_not():
    # 12 requests/s of 1,000-token prompts, 0.18 s of prefill each (4 chunks): 2.2 s of work a second,
    # so one prefill replica is short and four are not.
    arrivals = [(i / 12, 1000, 4) for i in range(12 * 30)]
    short = run(arrivals, 30, Fixed(1), decode=4, initial_prefill=1)
    enough = run(arrivals, 30, Fixed(4), decode=4, initial_prefill=4)
    late = [r.ttft() for r in short.requests[-20:]]
    early = [r.ttft() for r in short.requests[:20]]
    assert min(late) > 5 * max(early)  # the queue grows: the later a request, the longer it waits
    ok = [r.ttft() for r in enough.requests]
    assert max(ok) < 2 * min(ok) + 0.5  # no queue when capacity suffices
    # The decode pool had capacity either way: its inter-token latency does not see the prefill queue.
    assert max(dis.inter_token_latency(r) for r in short.requests) < 0.1


def test_no_prefill_replica_at_all_means_no_first_token():
    fleet = run([(1.0, 100, 5)], 20, Fixed(0), initial_prefill=0, hold_timeout_s=5.0)
    assert fleet.requests[0].first_token is None and fleet.requests[0].failed


def test_short_prompts_stay_on_the_decode_pool():
    fleet = run([(1.0, 50, 3), (1.0, 500, 3)], 20, Fixed(1), min_prompt_tokens=256)
    short, long = fleet.requests
    assert short.ttft() == pytest.approx(MODEL.a + MODEL.c * 50)  # prefilled in one decode-engine step, no move
    assert long.ttft() > MOVE * 256  # went through the prefill pool and the move


def test_a_long_prompt_stalls_the_streams_of_an_aggregated_engine_but_not_of_the_decode_pool():
    arrivals = [(0.0, 10, 200), (1.0, 5000, 2)]
    aggregated = sim.simulate(arrivals, 30, MODEL, sim.Schedule([1] * 1000), 1)
    fleet = run(arrivals, 30, Fixed(1))
    stream_agg, stream_dis = aggregated.requests[0], fleet.requests[0]
    assert dis.inter_token_latency(stream_agg) > dis.inter_token_latency(stream_dis) + 0.001
    assert dis.inter_token_latency(stream_dis) == pytest.approx(MODEL.a + MODEL.b, rel=0.1)


def test_the_prefill_pool_scales_with_the_operators_decision_on_queued_tokens():
    spec = dis.PrefillAutoscalingSpec(enabled=True, min_replicas=1, max_replicas=6,
                                      target_queued_prompt_tokens_per_replica=2000)
    arrivals = [(10 + i / 20, 1000, 4) for i in range(20 * 20)]  # 20,000 tokens/s for 20 s
    fleet = run(arrivals, 60, dis.PrefillPolicy(spec, None), decode=4)
    assert max(n for _, n in fleet.prefill_log) >= 3
    assert max(n for _, n in fleet.decode_log) == 4  # the decode pool is the other policy's
    assert fleet.prefill_hours() > 0 and fleet.decode_hours() == pytest.approx(4 * 60 / 3600)


def test_the_decode_pools_histogram_holds_inter_token_latency():
    fleet_arrivals = [(1.0, 10, 11)]
    replica = dis.DecodeReplica(0, 0.0)
    req = sim.Request(*fleet_arrivals[0])
    replica.waiting.append(req)
    now = 0.0
    while req.done is None:
        now += replica.plan_step(MODEL)
        replica.finish_step(now)
    itl = dis.inter_token_latency(req)
    buckets = dict(replica.histogram())
    below = max(b for b in sim.BOUNDS if b < itl)
    assert buckets[below] == 0 and buckets[min(b for b in sim.BOUNDS if b >= itl)] == 1
