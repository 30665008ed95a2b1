"""The oracle: the fewest replicas per minute that meet the SLO, knowing the trace; its cache; the dwell oracle."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from . import cluster, engine, measure, simulation, traces, wake
from .cluster import MAX_REPLICAS
from .engine import EngineModel, Workload
from .measure import capacity
from .simulation import Schedule, simulate


def oracle_schedule(arrivals: list[tuple[float, int, int]], duration: float, model: EngineModel,
                    workload: Workload, target: float, min_replicas: int, max_replicas: int = MAX_REPLICAS,
                    goal: float = 0.99) -> list[int]:
    """The oracle knows the trace. Minute by minute, in order: the fewest replicas n for
    minute m such that a replay of minutes m-1 and m (the trace's own arrivals; minute m-1
    at the n the oracle chose for it, as a warm-up that leaves the same backlog; then n from
    the start of minute m, ready at once, removed replicas draining) gives at least `goal` of
    minute m's arrivals a TTFT within `target`. With minReplicas 0, a minute with no arrival
    in it or in the minute before gets 0."""
    per_replica = capacity(model, workload)
    schedule: list[int] = []
    for m in range(math.ceil(duration / 60)):
        start, end = m * 60.0, (m + 1) * 60.0
        window = [(t - start + 60.0, p, o) for t, p, o in arrivals if start - 60.0 <= t < end]
        judged = sum(1 for t, _, _ in window if t >= 60.0)
        previous = schedule[-1] if schedule else None
        if not judged:
            schedule.append(min_replicas if not window else max(1, min_replicas))
            continue
        # Fewer replicas than the minute's work needs cannot do; start a little below that bound.
        n = max(1, min_replicas, math.ceil(0.8 * judged / 60.0 / per_replica))
        while n < max_replicas:
            warm = previous or n
            run = simulate(window, 120.0, model, Schedule([warm, n]), warm, cold_start_s=0.0)
            scored = [r for r in run.requests if r.arrival >= 60.0]
            met = sum(1 for r in scored if r.ttft() is not None and r.ttft() <= target)
            if met >= goal * len(scored):
                break
            n += 1
        schedule.append(n)
    return schedule


ORACLE_MODULES = (engine, wake, cluster, simulation, traces, measure)
"""The modules whose code the oracle runs (besides this one): the engine model, the cluster it replays, one run,
and capacity (traces.py for the Trace type it imports). The cache key hashes their text and this module's, never the
policies', the run's or the report's, so an edit to a policy keeps the cache (tests/unit/bench/test_autoscale_sim.py
traces an oracle's run and checks every simulator file it executes is here)."""


def oracle_source() -> bytes:
    """The text the oracle's results depend on: this module and ORACLE_MODULES, in a fixed order."""
    return b"".join(Path(m.__file__).read_bytes() for m in (*ORACLE_MODULES, sys.modules[__name__]))


def oracle_key(arrivals: list[tuple[float, int, int]], duration: float, model: EngineModel, workload: Workload,
               target: float, min_replicas: int) -> str:
    """The cache's name for one oracle: its inputs and the text of the code it runs."""
    import hashlib
    return hashlib.sha256(oracle_source()
                          + repr((arrivals, duration, model, workload, target, min_replicas)).encode()).hexdigest()


def cached_oracle_schedule(cache: Path | None, arrivals: list[tuple[float, int, int]], duration: float,
                           model: EngineModel, workload: Workload, target: float, min_replicas: int) -> list[int]:
    """oracle_schedule, kept in `cache` (a folder; None: computed every time). The oracle depends only on the
    trace's arrivals, the engine model and the simulator's engine, cluster and run (never on a policy), and it is
    most of a run's time (minutes per trace and seed on a loaded 2-vCPU machine), so runs that judge policy variants
    reuse it. The key (oracle_key) hashes the inputs and the text of the modules the oracle runs, so an edit to one
    of those computes it afresh and an edit to a policy does not."""
    if cache is None:
        return oracle_schedule(arrivals, duration, model, workload, target, min_replicas)
    path = cache / f"oracle-{oracle_key(arrivals, duration, model, workload, target, min_replicas)[:32]}.json"
    if path.exists():
        return [int(n) for n in json.loads(path.read_text())]
    schedule = oracle_schedule(arrivals, duration, model, workload, target, min_replicas)
    cache.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(schedule))
    return schedule


def dwell_schedule(per_minute: list[int], minutes: int = 5) -> list[int]:
    """The oracle held for `minutes` at a time (kaon's scale-down stabilization): each block
    of minutes gets the most replicas any of its minutes needs."""
    out = []
    for start in range(0, len(per_minute), minutes):
        block = per_minute[start:start + minutes]
        out += [max(block)] * len(block)
    return out
