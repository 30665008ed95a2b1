"""The whole run of one trace: its configuration, every policy on it against the oracles, the rows, pooling."""
from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import autoscaler

from .cluster import MAX_REPLICAS, Scrape
from .engine import EngineModel, Workload
from .oracle import cached_oracle_schedule, dwell_schedule
from .policies import HPA, KPA, Kaon
from .simulation import Poke, Policy, Schedule, simulate
from .traces import Trace, arrivals_for
from .wake import PROFILED, Wake

HPA_FRONTIER = (0.5, 0.6, 0.7, 0.8, 0.9)
"""The HPA run again at these shares of its target: its replica-hours for each SLO it can
reach, so that kaon is compared with the cheapest HPA setting at kaon's SLO or better (one
HPA target is one point; at another SLO it is not the policy a user would have tuned)."""


@dataclass
class Config:
    model: EngineModel
    workload: Workload = Workload()  # noqa: RUF009 (a frozen dataclass: one shared default is safe)
    ttft_target_s: float = 4.0
    drain_s: float = 30.0
    hold_timeout_s: float = 600.0
    scrape_failure_p: float = 0.0
    seed: int = 0
    minutes: float = 90.0
    target_concurrency: float | None = None
    """Requests per replica for kaon, HPA and KPA alike; None: kaon's default (targetUtilization x maxNumSeqs)."""
    standby: int = 3
    """kaon-standby's spec.autoscaling.standby: replicas kept loaded and asleep."""
    wake: Wake = field(default_factory=lambda: replace(PROFILED))
    """From a scale-up to a woken standby taking requests (Wake: the profiled one, or a constant --wake-s)."""
    standby_cost: float = 0.1
    """What a standby replica costs, as a share of an awake one's: counted in kaon-standby's replica-hours."""
    standby_window_s: int = 15
    """kaon-standby's scaleUpWindowSeconds: with starts that cheap, a shorter look back reacts sooner."""
    standby_stabilization_s: int = 120
    """kaon-standby's scaleDownStabilizationSeconds: a replica let go comes back in a wake."""
    standby_idle_s: int = 30
    """kaon-standby's scaleToZeroIdleSeconds (minReplicas 0): back from zero is a wake, not a cold start, so
    the idle time before zero need not outlast a cold start (the other policies': max(120, 2 x cold start))."""
    standby_max_step: int = 4
    """kaon-standby's maxStep: a step up of several replicas costs several wakes, not several cold starts."""
    poke_interval_s: float = 1.0
    """kaon-standby's pressure loop: how often the operator reads the router's GET /pressure (0: no such loop)."""
    poke_latency_s: float = 0.5
    """From the router's answer to spec.replicas written and the wake sent (the wake's own wake_s comes after)."""
    poke_loss: float = 0.05
    """The share of the router's answers lost (not answered in time): the regular scrape decides then."""
    only: tuple[str, ...] = ()
    """Run only these policies (and the two oracles, the yardstick); empty: all."""
    oracle_cache: Path | None = None
    """A folder keeping the oracle's schedules between runs (cached_oracle_schedule); None: none."""


def kaon_spec(config: Config, min_replicas: int) -> AutoscalingSpec:
    """What a user would write: the CRD defaults, the TTFT SLO as the P99 target, and with
    minReplicas 0 an idle time before zero that outlasts a cold start."""
    idle = max(120, math.ceil(2 * config.model.cold_start_s)) if min_replicas == 0 else None
    return AutoscalingSpec(enabled=True, min_replicas=min_replicas, max_replicas=MAX_REPLICAS,
                           target_concurrency_per_replica=config.target_concurrency,
                           target_p99_latency_seconds=config.ttft_target_s, latency_metric="ttft",
                           scale_to_zero_idle_seconds=idle,
                           scale_from_zero_timeout_seconds=int(config.hold_timeout_s))


def policies(config: Config, trace: Trace, oracle: list[int]) -> list[Policy]:
    def scrape() -> Scrape:  # every policy sees the same scrape failures
        return Scrape(config.scrape_failure_p, random.Random(config.seed + 7))

    spec = kaon_spec(config, trace.min_replicas)
    target = autoscaler.concurrency_target(spec, config.model.max_num_seqs)
    out: list[Policy] = [Kaon(spec, config.model.max_num_seqs, scrape()),
                         Kaon(spec, config.model.max_num_seqs, scrape(), model=config.model.perf_model())]
    # Knative's per-pod target is containerConcurrency x utilization: the same requests per pod.
    out += [HPA(target, trace.min_replicas, MAX_REPLICAS, scrape()),
            *(HPA(target * m, trace.min_replicas, MAX_REPLICAS, scrape(), f"hpa-x{m:g}") for m in HPA_FRONTIER),
            KPA(config.model.max_num_seqs, trace.min_replicas, MAX_REPLICAS, scrape(),
                utilization=target / config.model.max_num_seqs),
            Schedule(oracle), Schedule(dwell_schedule(oracle), "oracle-dwell")]
    if config.standby:  # the predictive policy, told that a start takes a wake (its first `standby` ones do)
        woken = replace(config.model.perf_model(), cold_start_seconds=config.wake.mean())
        quick = spec.model_copy(update={"standby": config.standby, "scale_up_window_seconds": config.standby_window_s,
                                        "scale_down_stabilization_seconds": config.standby_stabilization_s,
                                        "max_step": config.standby_max_step,
                                        **({"scale_to_zero_idle_seconds": config.standby_idle_s}
                                           if spec.scale_to_zero_idle_seconds else {})})
        out.append(Kaon(quick, config.model.max_num_seqs, scrape(), model=woken, name="kaon-standby"))
    return out


def run_trace(config: Config, trace: Trace) -> tuple[list[dict], dict]:
    model = config.model
    arrivals = arrivals_for(trace, config.workload, config.seed)
    oracle = cached_oracle_schedule(config.oracle_cache, arrivals, trace.duration, model, config.workload,
                                    config.ttft_target_s, trace.min_replicas)
    initial = oracle[0]
    runs = {}
    for policy in policies(config, trace, oracle):
        if config.only and policy.name not in config.only and not policy.name.startswith("oracle"):
            continue
        cold = 0.0 if policy.name.startswith("oracle") else None
        wake = replace(config.wake, rng=random.Random(config.seed + 13))  # its own draws: no other stream moves
        sleepers = dict(standby=config.standby, wake_s=wake, standby_cost=config.standby_cost,
                        poke=Poke(config.poke_interval_s, config.poke_latency_s, config.poke_loss,
                                  random.Random(config.seed + 11)) if config.poke_interval_s > 0 else None) \
            if policy.name == "kaon-standby" else {}
        runs[policy.name] = simulate(arrivals, trace.duration, model, policy, initial, cold_start_s=cold,
                                     drain_s=config.drain_s, hold_timeout_s=config.hold_timeout_s, **sleepers)
    if "kaon-standby" in runs and config.standby_cost != 1.0:
        # The same run with every standby costing a whole replica: a dedicated GPU, which a sleeping
        # engine keeps (it freed the device memory, but the pod still holds the device).
        runs["kaon-standby@1.0"] = replace(runs["kaon-standby"], standby_cost=1.0)
    oracle_hours, dwell_hours = runs["oracle"].replica_hours(), runs["oracle-dwell"].replica_hours()
    rows = []
    for name, run in runs.items():
        hours = run.replica_hours()
        rows.append({
            "trace": trace.name, "policy": name,
            "slo_attainment": round(run.attainment(config.ttft_target_s), 5),
            "replica_hours_vs_oracle": round(hours / oracle_hours, 3) if oracle_hours else None,
            "replica_hours_vs_dwell_oracle": round(hours / dwell_hours, 3) if dwell_hours else None,
            "changes_per_hour": round(run.changes / (trace.duration / 3600), 2),
            "cut_requests": run.cut,
            "replica_hours": round(hours, 3),
            "standby_hours": round(run.standby_hours(), 3),
            "requests": len(run.requests),
            "failed_held": sum(1 for r in run.requests if r.failed),
            "p99_ttft_s": round(percentile([r.ttft() for r in run.requests if r.ttft() is not None], 0.99), 3),
        })
    series = {"trace": trace, "arrivals": arrivals, "runs": runs}
    return rows, series


def pooled(rows: list[dict]) -> list[dict]:
    """Rows of several seeds as one per (trace, policy): requests, misses, hours, changes and
    cuts summed over the seeds, ratios taken of the sums, the worst seed's P99. One seed's
    90 minutes hold a few thousand requests, so 99% is judged on a few dozen misses, and a
    policy's rank against another moves with the seed."""
    out: dict[tuple[str, str], dict] = {}
    for r in rows:
        key = (r["trace"], r["policy"])
        if key not in out:
            out[key] = {**r, "seeds": 0, "met": 0.0, "hours_total": 0.0, "changes": 0.0, "requests": 0,
                        "standby_hours": 0.0, "cut_requests": 0, "failed_held": 0, "p99_ttft_s": 0.0}
        o = out[key]
        o["seeds"] += 1
        o["met"] += r["slo_attainment"] * r["requests"]
        o["requests"] += r["requests"]
        o["hours_total"] += r["replica_hours"]
        o["standby_hours"] = round(o["standby_hours"] + r.get("standby_hours", 0.0), 3)
        o["changes"] += r["changes_per_hour"]
        o["cut_requests"] += r["cut_requests"]
        o["failed_held"] += r["failed_held"]
        o["p99_ttft_s"] = max(o["p99_ttft_s"], r["p99_ttft_s"])
    for (trace, _), o in out.items():
        o["slo_attainment"] = round(o.pop("met") / o["requests"], 5)
        o["replica_hours"] = round(o.pop("hours_total"), 3)
        o["changes_per_hour"] = round(o.pop("changes") / o["seeds"], 2)
        for name, column in (("oracle", "replica_hours_vs_oracle"), ("oracle-dwell", "replica_hours_vs_dwell_oracle")):
            hours = sum(r["replica_hours"] for r in rows if r["trace"] == trace and r["policy"] == name)
            o[column] = round(o["replica_hours"] / hours, 3) if hours else None
    return list(out.values())


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
