"""A calibrated discrete-event simulator that judges kaon's autoscaling policy.

The command line of bench/autoscale_sim.py (its flags and output unchanged since the split).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

from kaon_operator.autoscaling import autoscaler, router_pressure

from . import ROOT
from .engine import EngineModel, Workload
from .measure import capacity, slo_concurrency
from .report import iso_slo, iso_table, plot, policy_version, table
from .run import HPA_FRONTIER, Config, kaon_spec, pooled, run_trace
from .traces import traces
from .wake import ENGINE_WAKE_S, PROFILED, READY_TO_ROUTER_S, Wake

CALIBRATION = ROOT / "bench" / "data" / "autoscale_calibration.json"


def load_model(args: argparse.Namespace) -> EngineModel:
    calibration = json.loads(Path(args.calibration).read_text()) if Path(args.calibration).exists() else {}
    step_ms = [float(x) for x in args.step_ms.split(",")] if args.step_ms else calibration.get("step_ms")
    cold = args.cold_start_s if args.cold_start_s is not None else calibration.get("cold_start_s")
    if step_ms is None or cold is None:
        raise SystemExit(f"no calibration at {args.calibration}: run --calibrate, or pass --step-ms and --cold-start-s")
    a, b, c, d = (x / 1e3 for x in [*step_ms, 0.0][:4])
    return EngineModel(a, b, c, cold, args.max_num_seqs or calibration.get("max_num_seqs", 64),
                       args.max_num_batched_tokens or calibration.get("max_num_batched_tokens", 1024), d)


def wake_of(args: argparse.Namespace) -> Wake:
    if args.wake_s is not None and args.engine_wake_s is not None:
        raise SystemExit("--wake-s (a constant wake) and --engine-wake-s (the profiled one's engine part) "
                         "exclude each other")
    if args.wake_s is not None:
        return Wake(args.wake_s)
    return replace(PROFILED, engine_s=ENGINE_WAKE_S if args.engine_wake_s is None else args.engine_wake_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calibrate", action="store_true", help="measure the engine here, write --calibration")
    parser.add_argument("--calibration", default=str(CALIBRATION))
    parser.add_argument("--step-ms", help="a,b,c[,d]: step ms = a + b * batch + c * prefill tokens "
                        "+ d * context tokens (e.g. GPU figures)")
    parser.add_argument("--cold-start-s", type=float)
    parser.add_argument("--max-num-seqs", type=int)
    parser.add_argument("--max-num-batched-tokens", type=int)
    parser.add_argument("--ttft-target", type=float, default=4.0, help="seconds")
    parser.add_argument("--target-concurrency", default="slo",
                        help="requests per replica for every policy: a number, 'slo' (what one replica carries "
                             "while meeting the TTFT target, measured in the model) or 'default' "
                             "(kaon's CRD default, targetUtilization x maxNumSeqs)")
    parser.add_argument("--drain-s", type=float, default=30.0)
    parser.add_argument("--hold-timeout-s", type=float, default=600.0)
    parser.add_argument("--scrape-failure", type=float, default=0.0, help="probability a pod misses a scrape")
    parser.add_argument("--minutes", type=float, default=90.0, help="length of every trace")
    parser.add_argument("--standby", type=int, default=3,
                        help="kaon-standby's spec.autoscaling.standby (0: no such row)")
    parser.add_argument("--wake-s", type=float,
                        help="a constant wake: seconds from a scale-up to a woken standby taking requests, all parts "
                        "in one (the standby figures before the profiled wake used 3). Default: the profiled wake "
                        f"(Wake, PROFILED: the engine's {ENGINE_WAKE_S:g} s, U(0, {PROFILED.probe_period_s:g}) s "
                        f"readiness probe, {READY_TO_ROUTER_S:g} s to the routers, U(0, {PROFILED.round_s:g}) s "
                        "standby round on regular scale-ups)")
    parser.add_argument("--engine-wake-s", type=float,
                        help="the profiled wake with this engine wake instead of the bundled model's "
                        f"{ENGINE_WAKE_S:g} s (e.g. a GPU's), the other parts kept")
    parser.add_argument("--standby-cost", type=float, default=0.1,
                        help="a standby replica's cost as a share of an awake one's, counted in kaon-standby's "
                        "replica-hours: about 0.1 where a sleeping (level 2) replica holds only host memory and its "
                        "GPU goes to other work (shared GPUs, DRA); 1.0 where it keeps a whole GPU")
    parser.add_argument("--standby-window-s", type=int, default=15, help="kaon-standby's scaleUpWindowSeconds")
    parser.add_argument("--standby-idle-s", type=int, default=30,
                        help="kaon-standby's scaleToZeroIdleSeconds where minReplicas is 0 (back from zero is a wake)")
    parser.add_argument("--standby-stabilization-s", type=int, default=120,
                        help="kaon-standby's scaleDownStabilizationSeconds")
    parser.add_argument("--poke-interval-s", type=float, default=1.0,
                        help="kaon-standby: how often the operator reads the routers' GET /pressure (held requests, "
                        "requests in flight) and wakes standbys when capacity is short; 0: no such signal")
    parser.add_argument("--poke-latency-s", type=float, default=0.5,
                        help="from the routers' answer to the wake sent (the wake itself takes --wake-s more)")
    parser.add_argument("--poke-loss", type=float, default=0.05, help="share of the routers' answers lost")
    parser.add_argument("--policies", nargs="+", default=[],
                        help="run only these policies (the oracles always run): e.g. kaon-predictive kaon-standby")
    parser.add_argument("--oracle-cache", type=Path,
                        help="a folder (outside the repo, e.g. ~/.cache/kaon/autoscale_oracle) that keeps the "
                        "oracle's schedules between runs: it depends on the trace and the engine, never on a policy, "
                        "and is most of a run's time")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=1, help="run every trace with seeds seed..seed+N-1 and pool them")
    parser.add_argument("--traces", nargs="+")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--plot", type=Path)
    args = parser.parse_args(argv)
    if args.calibrate:
        import autoscale_calibrate
        print(json.dumps(autoscale_calibrate.calibrate(Path(args.calibration)), indent=2))
        return 0
    model = load_model(args)
    workload = Workload()
    target = {"default": None, "slo": None}.get(args.target_concurrency)
    if args.target_concurrency == "slo":
        target = round(slo_concurrency(model, workload, args.ttft_target), 1)
    elif args.target_concurrency != "default":
        target = float(args.target_concurrency)
    config = Config(model, workload, ttft_target_s=args.ttft_target, drain_s=args.drain_s,
                    hold_timeout_s=args.hold_timeout_s, scrape_failure_p=args.scrape_failure, seed=args.seed,
                    minutes=args.minutes, target_concurrency=target, standby=args.standby, wake=wake_of(args),
                    standby_cost=args.standby_cost, standby_window_s=args.standby_window_s,
                    standby_stabilization_s=args.standby_stabilization_s, standby_idle_s=args.standby_idle_s,
                    poke_interval_s=args.poke_interval_s,
                    poke_latency_s=args.poke_latency_s, poke_loss=args.poke_loss, only=tuple(args.policies),
                    oracle_cache=args.oracle_cache.expanduser() if args.oracle_cache else None)
    rows = []
    started = time.perf_counter()
    for seed in range(args.seed, args.seed + args.seeds):
        config = replace(config, seed=seed)
        for trace in traces(capacity(config.model, config.workload), seed, config.minutes):
            if args.traces and trace.name not in args.traces:
                continue
            trace_rows, series = run_trace(config, trace)
            rows += trace_rows
            if args.plot and seed == args.seed:
                plot(series, config.ttft_target_s, args.plot)
            if not args.json:
                print(f"{trace.name} seed {seed} done ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.seeds > 1:
        rows = pooled(rows)
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        m = config.model
        print(f"engine: step = {m.a * 1e3:.2f} + {m.b * 1e3:.3f} x batch + {m.c * 1e3:.4f} x prefill tokens "
              f"+ {m.d * 1e3:.6f} x context tokens (ms); "
              f"cold start {m.cold_start_s:g} s; maxNumSeqs {m.max_num_seqs}; "
              f"one replica's capacity {capacity(m, config.workload):.2f} req/s; workload: prompts "
              f"{config.workload.prompt}, outputs {config.workload.output} tokens")
        spec = kaon_spec(config, 1)
        print(f"concurrency target per replica (all policies): "
              f"{autoscaler.concurrency_target(spec, m.max_num_seqs):g}; drain {config.drain_s:g} s; "
              f"scrape failures {config.scrape_failure_p:g}; {config.minutes:g} min per trace; "
              f"seeds {args.seed}..{args.seed + args.seeds - 1}" + (" pooled" if args.seeds > 1 else ""))
        print(f"kaon policy: operator/kaon_operator/autoscaling/autoscaler.py, git blob {policy_version()}")
        if config.standby:
            print(f"kaon-standby: kaon-predictive with spec.autoscaling.standby {config.standby} ("
                  f"{config.wake.describe()}; a standby costs {config.standby_cost:g} of an awake replica, counted "
                  f"in its replica-hours), scaleUpWindowSeconds {config.standby_window_s}, "
                  f"scaleDownStabilizationSeconds {config.standby_stabilization_s}, maxStep {config.standby_max_step}, "
                  f"scaleToZeroIdleSeconds {config.standby_idle_s} (minReplicas 0); "
                  + (f"the routers' pressure read every {config.poke_interval_s:g} s, acted on "
                     f"{config.poke_latency_s:g} s later, {100 * config.poke_loss:g}% of reads lost "
                     f"(router_pressure.py, short at {router_pressure.SHORT_FACTOR:g}x the target)"
                     if config.poke_interval_s > 0 else "no router pressure signal"))
        print(table([r for r in rows if not r["policy"].startswith("hpa-x")], config.ttft_target_s))
        if not any(r["policy"].startswith("hpa") for r in rows) or \
                not any(r["policy"] == "kaon-predictive" for r in rows):
            return 0  # --policies left them out
        print(f"\nkaon-predictive against the HPA at {', '.join(f'{m:g}' for m in (*HPA_FRONTIER, 1))} x its "
              f"target (the cheapest that reaches kaon's SLO attainment or better):")
        print(iso_table(iso_slo(rows)))
    return 0
