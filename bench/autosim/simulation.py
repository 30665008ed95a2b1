"""One run: a policy over a trace's arrivals on a cluster, event by event, and what it cost."""
from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from kaon_operator.autoscaling import router_pressure

from .cluster import Cluster
from .engine import EngineModel, Request
from .wake import Wake


class Policy:
    name = "policy"
    period = 5.0

    def decide(self, cluster: Cluster) -> int:
        raise NotImplementedError

    def poked(self, cluster: Cluster, pressure: router_pressure.Pressure) -> int | None:
        """What the policy does with the routers' report (kaon with standbys: router_pressure.py); None: nothing."""
        return None


class Schedule(Policy):
    """Replicas per minute from a precomputed list (the oracle)."""
    name = "oracle"
    period = 60.0

    def __init__(self, per_minute: list[int], name: str = "oracle"):
        self.per_minute, self.name = per_minute, name

    def decide(self, cluster: Cluster) -> int:
        return self.per_minute[min(int(cluster.now // 60), len(self.per_minute) - 1)]


@dataclass
class Poke:
    """The operator's pressure loop (autoscaling/pressure_sync.py): it reads every router's GET /pressure each
    `interval_s`; a read is lost (a router that does not answer in time) with probability `loss`, and what it
    reports is acted on `latency_s` later (the read, the decision, spec.replicas written, the standby's wake sent;
    the wake itself is wake_s on top). Only what the router sees counts: requests held, or in flight to ready
    replicas."""
    interval_s: float = 1.0
    latency_s: float = 0.5
    loss: float = 0.05
    rng: random.Random = field(default_factory=random.Random)


@dataclass
class Run:
    requests: list[Request]
    pod_log: list[tuple[float, int]]
    replica_log: list[tuple[float, int]]
    changes: int
    cut: int
    duration: float
    standby_log: list[tuple[float, int]] = field(default_factory=list)
    standby_cost: float = 0.0
    """What a standby replica costs, as a share of an awake one's (see --standby-cost)."""
    standby_loads: list[list[float]] = field(default_factory=list)

    def replica_hours(self) -> float:
        """Awake (and starting, and draining) replica-hours, plus standby_cost x the standby replica-hours,
        except that a standby counts in full while it loads (it holds its device as any starting replica)."""
        return _hours(self.pod_log, self.duration) + self.standby_cost * self.standby_hours() \
            + (1.0 - self.standby_cost) * self.standby_loading_hours()

    def standby_loading_hours(self) -> float:
        return sum(max(0.0, min(end, self.duration) - min(start, self.duration))
                   for start, end in self.standby_loads) / 3600

    def standby_hours(self) -> float:
        return _hours(self.standby_log, self.duration)

    def attainment(self, target: float) -> float:
        met = sum(1 for r in self.requests if not r.failed and r.ttft() is not None and r.ttft() <= target)
        return met / len(self.requests) if self.requests else 1.0


def _hours(log: list[tuple[float, int]], duration: float) -> float:
    total = 0.0
    for (t0, n), (t1, _) in zip(log, [*log[1:], (duration, 0)]):
        total += n * (max(0.0, min(t1, duration) - min(t0, duration)))
    return total / 3600


def make_requests(arrivals: list[tuple[float, int, int]]) -> list[Request]:
    return [Request(t, p, o) for t, p, o in arrivals]


def simulate(arrivals: list[tuple[float, int, int]], duration: float, model: EngineModel, policy: Policy,
             initial: int, *, cold_start_s: float | None = None, drain_s: float = 30.0,
             hold_timeout_s: float = 600.0, standby: int = 0, wake_s: float | Wake = 0.0, standby_cost: float = 0.0,
             poke: Poke | None = None) -> Run:
    """Run one policy over one trace. Policies tick until `duration`; afterwards the engines
    finish what they have, so every request gets its outcome. `standby` replicas wait loaded and
    asleep; a scale-up wakes one in `wake_s` (seconds, or a Wake drawn per wake) and starts another behind it.
    With `poke` the operator
    also reads the router's pressure every `poke.interval_s` (each read lost with `poke.loss`, acted on
    `poke.latency_s` later) and the policy's `poked` acts on it."""
    cluster = Cluster(model, model.cold_start_s if cold_start_s is None else cold_start_s, drain_s, hold_timeout_s)
    requests = make_requests(arrivals)
    # The trace starts warm: the initial replicas are ready at time 0, the standbys loaded.
    saved, cluster.cold_start_s = cluster.cold_start_s, 0.0
    cluster.set_replicas(initial)
    cluster.standby, cluster.wake_s = standby, wake_s
    cluster.fill_standby(0.0)
    cluster.cold_start_s, cluster.last_change, cluster.replica_log = saved, None, [(0.0, initial)]
    changes = 0
    cluster.push(policy.period, "tick")
    cluster.push(1.0, "router")
    if poke is not None:
        cluster.push(poke.interval_s, "poll")
    i = 0
    while True:
        next_arrival = requests[i].arrival if i < len(requests) else math.inf
        if cluster.events and cluster.events[0][0] <= next_arrival:
            at, _, kind, what = heapq.heappop(cluster.events)
        elif next_arrival < math.inf:
            at, kind, what = next_arrival, "arrival", requests[i]
            i += 1
        else:
            break
        cluster.now = at
        if kind == "arrival":
            cluster.route(what)
        elif kind == "step":
            cluster.step_done(what)
        elif kind == "ready":
            cluster.release_held()
        elif kind == "drain":
            cluster.drain_deadline(what)
        elif kind == "router":
            cluster.release_held()
            if at + 1.0 < duration or cluster.held:
                cluster.push(at + 1.0, "router")
        elif kind == "poll" and poke is not None and at <= duration:
            if poke.rng.random() >= poke.loss:  # the router's answer (or the operator's read) is lost: no poke
                cluster.push(at + poke.latency_s, "poke", cluster.pressure())
            cluster.push(at + poke.interval_s, "poll")
        elif kind == "poke":
            wanted = policy.poked(cluster, what)
            if wanted is not None and wanted > len(cluster.active):
                cluster.set_replicas(wanted, poked=True)
                changes += 1
        elif kind == "tick" and at <= duration:
            wanted = policy.decide(cluster)
            if wanted != len(cluster.active):
                cluster.set_replicas(wanted)
                changes += 1
            cluster.push(at + policy.period, "tick")
        if at > duration and cluster.held and not cluster.active:
            cluster.set_replicas(1)  # the trace is over: serve what is left rather than lose it
    return Run(requests, cluster.pod_log, cluster.replica_log, changes, cluster.cut, duration, cluster.standby_log,
               standby_cost, cluster.standby_loads)
