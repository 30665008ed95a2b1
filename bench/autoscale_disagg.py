"""A disaggregated fleet in the autoscaling simulator (issue 50): a prefill pool and a decode pool.

    python bench/autoscale_disagg.py [--traces steady-60 mix-shift ...] [--seeds 3] [--json]

Built on bench/autoscale_sim.py's engine and cluster model (same calibration, traces and arrivals):

- A request whose prompt has at least `--min-prompt-tokens` tokens goes to the prefill pool first. A prefill
  engine computes `prompt - 1` tokens with the aggregated engine's step model (no decoding there:
  step = a + c x prompt tokens of the step, chunks of maxNumBatchedTokens, FIFO), as `kaon serve --role
  prefill` runs `prompt[:-1]` through its ordinary scheduler. The KV cache moves chunk by chunk while it is
  computed, so what the request waits for after its last chunk is that chunk's move:
  `transfer_s_per_token x min(prompt, maxNumBatchedTokens)` (3.3 s per 1,000 tokens measured with NIXL on
  this 2-core machine, bench/history/disagg.md). The decode engine then computes the last prompt token and
  samples the first output token in one of its own steps (TTFT ends there), and decodes.
  Shorter prompts are prefilled by the decode engine itself (the engine's local-prefill threshold).
- The prefill pool scales with the operator's own decision,
  `kaon_operator.autoscaling.prefill_scaling.decide`, fed every 5 s: the prompt tokens not computed yet on
  the ready prefill engines (`kaon_num_prompt_tokens_waiting`), the prompt tokens they accepted per second,
  and the P99 TTFT of the requests that got their first token since the last tick (taken from the requests
  themselves, where the operator reads the decode engines' histogram).
- The decode pool scales with the predictive policy (predictive.py) on the spec the operator gives it
  (`decode_pool_spec`: latency metric `itl`, the target `--itl-target`), its latency histogram holding
  each finished request's mean inter-token latency.
- The aggregated fleet is the simulator's kaon-predictive on the same arrivals.

Inter-token latency here is a request's mean gap between output tokens ((done - first token) / (output - 1)):
a long prefill chunk in an aggregated engine's step stretches every gap of that step. Nothing here queues
unless a pool's capacity is short: a request waits only for a busy engine or a starting replica.
"""
from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import random
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import autoscale_sim as sim  # it also puts operator/ on the path

from kaon_operator.api import AutoscalingSpec, PrefillAutoscalingSpec
from kaon_operator.autoscaling import prefill_scaling

TRANSFER_S_PER_TOKEN = 3.3e-3
"""The KV move alone, NIXL between two processes on this 2-core machine (bench/history/disagg.md, run 3)."""


class PrefillRequest(sim.Request):
    """What the prefill engine computes for one request: its prompt but the last token."""
    __slots__ = ("real",)

    def __init__(self, real: sim.Request):
        super().__init__(real.arrival, max(1, real.prompt - 1), 1)
        self.real = real


class DecodeReplica(sim.Replica):
    """A decode engine: its latency histogram (what the operator scrapes for the `itl` metric) holds each
    finished request's mean inter-token latency instead of TTFT."""

    def __init__(self, rid: int, ready_at: float):
        super().__init__(rid, ready_at)
        self.first_tokens: list[sim.Request] = []  # the requests whose first token came in the last step

    def finish_step(self, now: float) -> list[sim.Request]:
        ttft, chunks = list(self.ttft_counts), self.chunks
        done = super().finish_step(now)
        self.ttft_counts = ttft
        self.first_tokens = [req for req, _ in chunks if req.first_token == now]
        for req in done:
            itl = inter_token_latency(req)
            if itl is not None:
                self.ttft_counts[bisect.bisect_left(sim.BOUNDS, itl)] += 1
        return done


class DecodePool(sim.Cluster):
    """The decode pool: engines that get requests whose prompt is computed but its last token."""
    replica_type = DecodeReplica

    def __init__(self, *args: object, **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.recent_ttft: list[float] = []  # first tokens since the last prefill tick: the prefill pool's signal

    def _send(self, replica: sim.Replica, req: sim.Request) -> None:
        replica.waiting.append(req)
        replica.prompt_tokens += req.todo  # the engine's prompt-token counter counts what it computes
        if not replica.stepping:
            self._start_step(replica)


class PrefillPool(sim.Cluster):
    """The prefill pool: a request leaves it when its prompt is computed, for the decode pool after the move."""

    def __init__(self, *args: object, handoff: object = None, **kw: object):
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.handoff = handoff

    def step_done(self, replica: sim.Replica) -> None:
        if replica.gone:
            return
        for req in replica.finish_step(self.now):
            self.handoff(req)  # type: ignore[operator]
        if replica.draining_since is not None and replica.in_flight == 0:
            self._remove(replica)
            return
        self._start_step(replica)

    def queued_prompt_tokens(self) -> float:
        """`kaon_num_prompt_tokens_waiting` summed over the ready engines: waiting or mid-prefill."""
        return float(sum(sum(r.todo for r in (*rep.waiting, *rep.prefilling)) for rep in self.ready()))


def inter_token_latency(req: sim.Request) -> float | None:
    if req.done is None or req.first_token is None or req.output <= 1:
        return None
    return (req.done - req.first_token) / (req.output - 1)


@dataclass
class PrefillPolicy:
    spec: PrefillAutoscalingSpec
    model: sim.perf_model.PerfModel | None
    period: float = 5.0
    last_change: float | None = None
    tokens_seen: dict[int, int] | None = None

    def decide(self, prefill: PrefillPool, decode: DecodePool) -> int:
        seen = self.tokens_seen if self.tokens_seen is not None else {}
        accepted = 0
        for r in prefill.ready():
            accepted += r.prompt_tokens - seen.get(r.id, 0)
            seen[r.id] = r.prompt_tokens
        self.tokens_seen = seen
        ttfts, decode.recent_ttft = decode.recent_ttft, []
        p99 = sim.percentile(ttfts, 0.99) if ttfts else None
        load = prefill_scaling.PrefillLoad(prefill.queued_prompt_tokens(), p99, accepted / self.period,
                                           ready_replicas=len(prefill.ready()))
        wanted, _ = prefill_scaling.decide(load, self.spec, len(prefill.active), prefill.now, self.last_change,
                                           self.model)
        if wanted != len(prefill.active):
            self.last_change = prefill.now
        return wanted


@dataclass
class Fleet:
    requests: list[sim.Request]
    prefill_log: list[tuple[float, int]]
    decode_log: list[tuple[float, int]]
    cut: int
    duration: float

    def prefill_hours(self) -> float:
        return sim._hours(self.prefill_log, self.duration)

    def decode_hours(self) -> float:
        return sim._hours(self.decode_log, self.duration)


def simulate_disagg(arrivals: list[tuple[float, int, int]], duration: float, model: sim.EngineModel,
                    prefill_policy: PrefillPolicy, decode_policy: sim.Policy, initial_prefill: int,
                    initial_decode: int, *, min_prompt_tokens: int = 0,
                    transfer_s_per_token: float = TRANSFER_S_PER_TOKEN, cold_start_s: float | None = None,
                    drain_s: float = 30.0, hold_timeout_s: float = 600.0) -> Fleet:
    """Run one trace through a prefill pool and a decode pool, each scaled by its own policy. As
    `sim.simulate`: policies tick until `duration`, then the engines finish what they have."""
    cold = model.cold_start_s if cold_start_s is None else cold_start_s
    # A prefill engine decodes nothing: its step has no per-sequence cost.
    prefill_model = replace(model, b=0.0, d=0.0)
    decode = DecodePool(model, cold, drain_s, hold_timeout_s)
    prefill = PrefillPool(prefill_model, cold, drain_s, hold_timeout_s)
    moves: list[tuple[float, int, sim.Request]] = []  # KV caches on their way to the decode pool
    proxies: list[PrefillRequest] = []

    def handoff(done: sim.Request) -> None:
        real = done.real  # type: ignore[attr-defined]
        real.todo = 1  # the decode engine computes the last prompt token and samples the first output token
        at = prefill.now + transfer_s_per_token * min(real.prompt, model.max_num_batched_tokens)
        heapq.heappush(moves, (at, id(real), real))

    prefill.handoff = handoff
    requests = sim.make_requests(arrivals)
    for pool, n in ((prefill, initial_prefill), (decode, initial_decode)):
        pool.cold_start_s = 0.0  # the trace starts warm
        pool.set_replicas(n)
        pool.cold_start_s, pool.last_change = cold, None
    prefill_policy.last_change = 0.0  # the pool was sized at the start: its scale-down waits its window
    decode.push(decode_policy.period, "tick")
    prefill.push(prefill_policy.period, "tick")
    for pool in (prefill, decode):
        pool.push(1.0, "router")
    i = 0
    while True:
        # The next thing to happen: an arrival, a KV cache arriving at the decode pool, or either pool's event.
        candidates = [(requests[i].arrival if i < len(requests) else math.inf, 0),
                      (moves[0][0] if moves else math.inf, 1),
                      (prefill.events[0][0] if prefill.events else math.inf, 2),
                      (decode.events[0][0] if decode.events else math.inf, 3)]
        at, which = min(candidates)
        if at == math.inf:
            break
        prefill.now = decode.now = at
        if which == 0:
            req = requests[i]
            i += 1
            if req.prompt >= min_prompt_tokens and req.prompt > 1:
                proxies.append(PrefillRequest(req))
                prefill.route(proxies[-1])
            else:
                decode.route(req)
        elif which == 1:
            decode.route(heapq.heappop(moves)[2])
        else:
            pool = prefill if which == 2 else decode
            _, _, kind, what = heapq.heappop(pool.events)
            if kind == "step":
                pool.step_done(what)  # type: ignore[arg-type]
            elif kind == "ready":
                pool.release_held()
            elif kind == "drain":
                pool.drain_deadline(what)  # type: ignore[arg-type]
            elif kind == "router":
                pool.release_held()
                if at + 1.0 < duration or pool.held:
                    pool.push(at + 1.0, "router")
            elif kind == "tick" and at <= duration:
                pool.set_replicas(prefill_policy.decide(prefill, decode) if pool is prefill
                                  else decode_policy.decide(decode))
                pool.push(at + (prefill_policy.period if pool is prefill else decode_policy.period), "tick")
            if kind == "step" and pool is decode:
                decode.recent_ttft += [r.first_token - r.arrival for r in what.first_tokens]  # type: ignore
        for pool in (prefill, decode):
            if at > duration and pool.held and not pool.active:
                pool.set_replicas(1)  # the trace is over: serve what is left rather than lose it
    # What happened to a request on the prefill pool (held too long, cut by a drain) happened to the request.
    for proxy in proxies:
        proxy.real.failed, proxy.real.cut = proxy.real.failed or proxy.failed, proxy.real.cut or proxy.cut
    return Fleet(requests, prefill.pod_log, decode.pod_log, prefill.cut + decode.cut, duration)


def attainment(requests: list[sim.Request], ttft_target: float, itl_target: float) -> dict[str, float]:
    n = len(requests) or 1
    ttft_ok = [r for r in requests if not r.failed and r.ttft() is not None and r.ttft() <= ttft_target]
    itl = [inter_token_latency(r) for r in requests]
    itl_ok = [r for r, x in zip(requests, itl) if r.done is not None and (x is None or x <= itl_target)]
    both = set(map(id, ttft_ok)) & set(map(id, itl_ok))
    return {"ttft": len(ttft_ok) / n, "itl": len(itl_ok) / n, "both": len(both) / n}


def decode_spec(config: sim.Config, min_replicas: int, itl_target: float) -> AutoscalingSpec:
    """The decode pool's spec.autoscaling as the operator passes it on (autoscale_loop.decode_pool_spec):
    the user's spec, its latency metric `itl` and the target an inter-token latency."""
    spec = sim.kaon_spec(config, min_replicas)
    return spec.model_copy(update={"latency_metric": "itl", "target_p99_latency_seconds": itl_target})


def prefill_spec(config: sim.Config) -> PrefillAutoscalingSpec:
    """spec.prefill.autoscaling as a user would write it: the CRD defaults, the TTFT SLO as its target."""
    return PrefillAutoscalingSpec(enabled=True, min_replicas=1, max_replicas=sim.MAX_REPLICAS,
                                  target_p99_ttft_seconds=config.ttft_target_s)


def run_trace(config: sim.Config, trace: sim.Trace, itl_target: float, min_prompt_tokens: int = 0,
              transfer_s_per_token: float = TRANSFER_S_PER_TOKEN) -> list[dict]:
    model = config.model
    arrivals = sim.arrivals_for(trace, config.workload, config.seed)
    per_replica = sim.capacity(model, config.workload)
    initial = max(trace.min_replicas, 1, round(trace.rate(0.5) / per_replica))

    def scrape() -> sim.Scrape:
        return sim.Scrape(config.scrape_failure_p, random.Random(config.seed + 7))

    spec = sim.kaon_spec(config, trace.min_replicas)
    aggregated = sim.simulate(arrivals, trace.duration, model,
                              sim.Kaon(spec, model.max_num_seqs, scrape(), model=model.perf_model()), initial,
                              drain_s=config.drain_s, hold_timeout_s=config.hold_timeout_s)
    decode_model = replace(model.perf_model())
    # Both fleets start as a user would have sized them for the trace's first rate: the aggregated one
    # by requests, the prefill pool by prompt tokens over 70% of one prefill replica's measured rate
    # (prefill_scaling.py's sizing).
    prompt_rate = trace.rate(0.5) * sum((trace.workload(0.5) if trace.workload else config.workload).prompt) / 2
    per_prefill = prefill_scaling.UTILIZATION * prefill_scaling.replica_capacity(model.perf_model())
    initial_prefill = max(1, math.ceil(prompt_rate / per_prefill))
    fleet = simulate_disagg(
        arrivals, trace.duration, model, PrefillPolicy(prefill_spec(config), model.perf_model()),
        sim.Kaon(decode_spec(config, max(1, trace.min_replicas), itl_target), model.max_num_seqs, scrape(),
                 model=decode_model, name="kaon-decode"),
        initial_prefill, initial, min_prompt_tokens=min_prompt_tokens, transfer_s_per_token=transfer_s_per_token,
        drain_s=config.drain_s, hold_timeout_s=config.hold_timeout_s)
    agg_hours = sim._hours(aggregated.pod_log, trace.duration)
    rows = []
    for name, reqs, hours, pools, cut in (
            ("aggregated", aggregated.requests, agg_hours, {}, aggregated.cut),
            ("disaggregated", fleet.requests, fleet.prefill_hours() + fleet.decode_hours(),
             {"prefill_hours": round(fleet.prefill_hours(), 3), "decode_hours": round(fleet.decode_hours(), 3)},
             fleet.cut)):
        att = attainment(reqs, config.ttft_target_s, itl_target)
        itls = [x for x in map(inter_token_latency, reqs) if x is not None]
        rows.append({"trace": trace.name, "seed": config.seed, "fleet": name,
                     "ttft_attainment": round(att["ttft"], 5), "itl_attainment": round(att["itl"], 5),
                     "slo_attainment": round(att["both"], 5), "replica_hours": round(hours, 3), **pools,
                     "hours_vs_aggregated": round(hours / agg_hours, 3) if agg_hours else None,
                     "p99_ttft_s": round(sim.percentile([r.ttft() for r in reqs if r.ttft() is not None], 0.99), 3),
                     "p99_itl_s": round(sim.percentile(itls, 0.99), 3) if itls else None,
                     "cut_requests": cut, "requests": len(reqs)})
    return rows


def pooled(rows: list[dict]) -> list[dict]:
    """Rows of several seeds as one per (trace, fleet): attainments over all their requests, hours summed,
    the worst seed's P99s (as autoscale_sim.pooled)."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        o = out.setdefault((r["trace"], r["fleet"]), {"trace": r["trace"], "seed": "all", "fleet": r["fleet"],
                                                     "requests": 0, "cut_requests": 0, "replica_hours": 0.0,
                                                     "p99_ttft_s": 0.0, "p99_itl_s": 0.0, "agg_hours": 0.0,
                                                     "_ok": [0.0, 0.0, 0.0]})
        for i, key in enumerate(("ttft_attainment", "itl_attainment", "slo_attainment")):
            o["_ok"][i] += r[key] * r["requests"]
        for key in ("requests", "cut_requests", "replica_hours"):
            o[key] += r[key]
        for key in ("prefill_hours", "decode_hours"):
            if key in r:
                o[key] = round(o.get(key, 0.0) + r[key], 3)
        o["agg_hours"] += r["replica_hours"] / r["hours_vs_aggregated"] if r["hours_vs_aggregated"] else 0.0
        o["p99_ttft_s"] = max(o["p99_ttft_s"], r["p99_ttft_s"])
        o["p99_itl_s"] = max(o["p99_itl_s"], r["p99_itl_s"] or 0.0)
    for o in out.values():
        ok = o.pop("_ok")
        n = o["requests"] or 1
        o["ttft_attainment"], o["itl_attainment"], o["slo_attainment"] = (round(x / n, 5) for x in ok)
        o["hours_vs_aggregated"] = round(o["replica_hours"] / o["agg_hours"], 3) if o["agg_hours"] else None
        del o["agg_hours"]
        o["replica_hours"] = round(o["replica_hours"], 3)
    return list(out.values())


def table(rows: list[dict]) -> str:
    head = (f"{'trace':11} {'seed':>4} {'fleet':13} {'TTFT ok':>8} {'ITL ok':>8} {'both':>8} {'repl-h':>7} "
            f"{'prefill-h':>9} {'decode-h':>8} {'vs agg':>7} {'P99 TTFT':>9} {'P99 ITL':>8} {'cut':>4}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['trace']:11} {r['seed']:>4} {r['fleet']:13} {100 * r['ttft_attainment']:7.2f}% "
            f"{100 * r['itl_attainment']:7.2f}% {100 * r['slo_attainment']:7.2f}% {r['replica_hours']:7.2f} "
            f"{r.get('prefill_hours', '-')!s:>9} {r.get('decode_hours', '-')!s:>8} "
            f"{r['hours_vs_aggregated'] or 0:6.2f}x {r['p99_ttft_s']:8.2f}s {r['p99_itl_s'] or 0:7.2f}s "
            f"{r['cut_requests']:4d}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibration", default=str(sim.CALIBRATION))
    parser.add_argument("--step-ms")
    parser.add_argument("--cold-start-s", type=float)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--ttft-target", type=float, default=4.0, help="seconds")
    parser.add_argument("--itl-target", type=float, default=0.5,
                        help="seconds: a request's mean inter-token latency (the decode pool's latency target)")
    parser.add_argument("--min-prompt-tokens", type=int, default=0,
                        help="prompts shorter than this are prefilled on the decode pool (0: every prompt moves)")
    parser.add_argument("--transfer-ms-per-1k", type=float, default=TRANSFER_S_PER_TOKEN * 1e6,
                        help="the KV move's cost per 1,000 prompt tokens (measured: 3,300 ms, NIXL, 2-core CPU)")
    parser.add_argument("--minutes", type=float, default=90.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--traces", nargs="+")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    model = sim.load_model(args)
    workload = sim.Workload()
    target = round(sim.slo_concurrency(model, workload, args.ttft_target), 1)
    config = sim.Config(model, workload, ttft_target_s=args.ttft_target, minutes=args.minutes,
                        target_concurrency=target, standby=0)
    rows: list[dict] = []
    for seed in range(args.seed, args.seed + args.seeds):
        config = replace(config, seed=seed)
        for trace in sim.traces(sim.capacity(model, workload), seed, config.minutes):
            if args.traces and trace.name not in args.traces:
                continue
            rows += run_trace(config, trace, args.itl_target, args.min_prompt_tokens, args.transfer_ms_per_1k / 1e6)
            print(f"{trace.name} seed {seed} done", file=sys.stderr)
    if args.seeds > 1:
        rows += pooled(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        print(f"engine: step = {model.a * 1e3:.2f} + {model.b * 1e3:.3f} x batch + {model.c * 1e3:.4f} x prefill "
              f"tokens (ms), cold start {model.cold_start_s:g} s; TTFT target {args.ttft_target:g} s, mean ITL target "
              f"{args.itl_target:g} s; prompts >= {args.min_prompt_tokens} tokens go to the prefill pool; KV move "
              f"{args.transfer_ms_per_1k:g} ms per 1,000 tokens (the last chunk's, the rest overlaps the prefill)")
        print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
