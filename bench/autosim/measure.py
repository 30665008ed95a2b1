"""What one replica carries, measured in the model: its capacity and the per-replica target at the SLO."""
from __future__ import annotations

import random

from .engine import EngineModel, Workload
from .simulation import Schedule, simulate
from .traces import Trace, arrivals_for


def capacity(model: EngineModel, workload: Workload, seed: int = 0) -> float:
    """Requests per second one replica sustains: measured in the model itself, on a replica
    that always has a queue (so its batch stays full), over the middle of the run."""
    rng = random.Random(seed)
    n = 40 * model.max_num_seqs
    backlog = [(0.0, rng.randint(*workload.prompt), rng.randint(*workload.output)) for _ in range(n)]
    run = simulate(backlog, 1.0, model, Schedule([1]), 1)
    ends = sorted(r.done for r in run.requests)
    first, last = ends[n // 4], ends[3 * n // 4]
    return (n // 2) / (last - first)


def slo_concurrency(model: EngineModel, workload: Workload, target_s: float, goal: float = 0.99,
                    seed: int = 0, replicas: int = 3) -> float:
    """The requests in flight (running + waiting) per replica at the highest steady load (in
    5% steps of capacity) where `replicas` replicas behind the router still meet the TTFT
    target for `goal` of the requests: what a user who load-tested the engine would set as
    the per-replica target. (Three replicas, as the traces' levels are; one replica alone is
    noisier, since least-connections cannot steer around a long prefill.)"""
    cap, best = capacity(model, workload, seed), 1.0
    for percent in range(10, 105, 5):
        rate = replicas * cap * percent / 100
        arrivals = arrivals_for(Trace("probe", 2400.0, lambda t, rate=rate: rate), workload, seed)
        run = simulate(arrivals, 2400.0, model, Schedule([replicas]), replicas)
        if run.attainment(target_s) < goal:
            break
        # Little's law: in flight = arrival rate x time in the system.
        best = rate * sum(r.done - r.arrival for r in run.requests) / len(run.requests) / replicas
    return best
