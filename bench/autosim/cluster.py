"""The cluster: the replicas of one InferenceService, the router in front, the standbys, the event queue.

The router sends each request to the ready replica with the fewest requests in flight, and holds
requests while no replica is ready (until one is, or the hold timeout). A new replica is ready after
the cold start (or a standby's wake). A removed replica takes no new requests and drains; what is
still in flight after the drain grace period is cut (and counted).
"""
from __future__ import annotations

import heapq
import random
from collections import deque
from dataclasses import dataclass, field

from kaon_operator.autoscaling import autoscaler, histogram, router_pressure

from .engine import EngineModel, Replica, Request
from .wake import Wake

MAX_REPLICAS = 10
"""The most replicas any policy (and the oracle) may run."""


@dataclass
class Scrape:
    """Per-policy scrape state: the per-pod baselines survive pods missing a scrape."""
    failure_p: float
    rng: random.Random
    finished: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    latency: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)


class Cluster:
    """The replicas of one InferenceService, the router in front and the event queue."""
    replica_type: type[Replica] = Replica  # a pool of another kind of engine (autoscale_disagg.py) overrides it

    def __init__(self, model: EngineModel, cold_start_s: float, drain_s: float, hold_timeout_s: float):
        self.model, self.cold_start_s, self.drain_s, self.hold_timeout_s = model, cold_start_s, drain_s, hold_timeout_s
        self.active: list[Replica] = []  # the replicas the Deployment wants (starting or ready)
        self.draining: list[Replica] = []
        self.held: deque[Request] = deque()
        self.events: list[tuple[float, int, str, object]] = []
        self.seq = 0
        self.next_id = 0
        self.now = 0.0
        self.cut = 0
        self.pod_log: list[tuple[float, int]] = [(0.0, 0)]  # (time, pods that exist): replica-hours
        self.replica_log: list[tuple[float, int]] = [(0.0, 0)]  # (time, replicas wanted): the plot
        self.last_change: float | None = None
        # Standby replicas (spec.autoscaling.standby): loaded and asleep, woken in wake_s by a scale-up,
        # a new one started behind each one woken. Each entry: when that standby is loaded (asleep).
        self.standby, self.wake = 0, Wake()
        self.sleepers: list[float] = []
        self.standby_log: list[tuple[float, int]] = [(0.0, 0)]  # (time, standby pods that exist)
        # [start, loaded] of every standby started behind a woken one: while it loads it holds its device
        # like any replica starting, so those seconds count in full whatever a sleeping standby costs.
        self.standby_loads: list[list[float]] = []

    @property
    def wake_s(self) -> float:
        """A wake's mean (a regular scale-up's)."""
        return self.wake.mean()

    @wake_s.setter
    def wake_s(self, value: float | Wake) -> None:
        self.wake = value if isinstance(value, Wake) else Wake(float(value))

    # events
    def push(self, at: float, kind: str, what: object = None) -> None:
        self.seq += 1
        heapq.heappush(self.events, (at, self.seq, kind, what))

    def _log_pods(self) -> None:
        self.pod_log.append((self.now, len(self.active) + len(self.draining)))

    def ready(self) -> list[Replica]:
        return [r for r in self.active if r.ready_at <= self.now]

    # the router
    def route(self, req: Request) -> None:
        ready = self.ready()
        if not ready:
            self.held.append(req)
            return
        self._send(min(ready, key=lambda r: r.in_flight), req)

    def _send(self, replica: Replica, req: Request) -> None:
        replica.waiting.append(req)
        replica.prompt_tokens += req.prompt
        if not replica.stepping:
            self._start_step(replica)

    def release_held(self) -> None:
        """Held requests go to ready replicas; those held too long are answered 503."""
        while self.held and self.now - self.held[0].arrival > self.hold_timeout_s:
            self.held.popleft().failed = True
        if self.held and self.ready():
            held, self.held = self.held, deque()
            for req in held:
                self.route(req)

    # engines
    def _start_step(self, replica: Replica) -> None:
        if replica.gone or not (replica.waiting or replica.running):
            replica.stepping = False
            return
        replica.stepping = True
        self.push(self.now + replica.plan_step(self.model), "step", replica)

    def step_done(self, replica: Replica) -> None:
        if replica.gone:
            return
        replica.finish_step(self.now)
        if replica.draining_since is not None and replica.in_flight == 0:
            self._remove(replica)
            return
        self._start_step(replica)

    def _remove(self, replica: Replica) -> None:
        replica.gone = True
        self.draining.remove(replica)
        self._log_pods()

    def drain_deadline(self, replica: Replica) -> None:
        if replica.gone:
            return
        cut = [*replica.waiting, *replica.prefilling, *(entry[2] for entry in replica.decoding)]
        for req in cut:
            req.cut = True
        self.cut += len(cut)
        self._remove(replica)

    # scaling
    def _start_at(self, round_delay: float = 0.0) -> float:
        """When a new active replica is ready: a standby's wake (the soonest loaded one, and a new standby
        starts behind it) after the standby loop's round (`round_delay`), else a cold start."""
        if not self.sleepers:
            return self.now + self.cold_start_s
        self.sleepers.sort()
        loaded = self.sleepers.pop(0)
        for load in self.standby_loads:  # one still loading becomes this replica: counted as such from now
            if load[1] == loaded and loaded > self.now:
                load[1] = max(load[0], self.now)
                break
        self.sleepers.append(self.now + self.cold_start_s)
        self.standby_loads.append([self.now, self.now + self.cold_start_s])
        return max(loaded, self.now) + self.wake.seconds(round_delay)

    def fill_standby(self, loaded_at: float) -> None:
        while len(self.sleepers) < self.standby:
            self.sleepers.append(loaded_at)
        self.standby_log.append((self.now, len(self.sleepers)))

    def set_replicas(self, wanted: int, poked: bool = False) -> None:
        """`poked`: ordered by the pressure loop, which wakes at once (no wait for the standby loop's round)."""
        if wanted == len(self.active):
            return
        self.last_change = self.now
        round_delay = self.wake.round_delay(poked) if wanted > len(self.active) and self.sleepers else 0.0
        while len(self.active) < wanted:
            replica = self.replica_type(self.next_id, self._start_at(round_delay))
            self.next_id += 1
            self.active.append(replica)
            self.push(replica.ready_at, "ready", replica)
        # Like a ReplicaSet: not-ready pods go first, then the newest.
        while len(self.active) > wanted:
            victim = max(self.active, key=lambda r: (r.ready_at > self.now, r.id))
            self.active.remove(victim)
            if self.sleepers and victim.ready_at <= self.now:
                # The operator puts the victim to sleep (after its drain) and removes the surplus standby,
                # the one still starting if any: the standby pool is loaded sooner, its size unchanged.
                self.sleepers.sort()
                if self.sleepers[-1] > self.now:  # the standby still loading is deleted now
                    for load in self.standby_loads:
                        if load[1] == self.sleepers[-1]:
                            load[1] = max(load[0], self.now)
                            break
                self.sleepers[-1] = min(self.sleepers[-1], self.now + self.drain_s)
            victim.draining_since = self.now
            self.draining.append(victim)
            if victim.in_flight == 0:
                self._remove(victim)
            else:
                self.push(self.now + self.drain_s, "drain", victim)
        self._log_pods()
        self.replica_log.append((self.now, len(self.active)))

    # metrics
    def scrape(self, state: Scrape) -> autoscaler.Sample:
        """Exactly the Sample the operator builds from the ready pods' /metrics and the routers."""
        ready = self.ready()
        answered = [r for r in ready if state.rng.random() >= state.failure_p]
        finished, prompt, output, finished_output, deltas = 0, 0, 0, 0, []
        for r in answered:
            finished += r.finished - state.finished.get(r.id, 0)
            state.finished[r.id] = r.finished
            before = state.tokens.get(r.id, (0, 0, 0))
            prompt, output = prompt + r.prompt_tokens - before[0], output + r.generated - before[1]
            finished_output += r.finished_output - before[2]
            state.tokens[r.id] = (r.prompt_tokens, r.generated, r.finished_output)
            buckets = r.histogram()
            deltas.append(histogram.bucket_delta(buckets, state.latency.get(r.id, ())))
            state.latency[r.id] = buckets
        return autoscaler.Sample(
            time=self.now, ready=len(ready), answered=len(answered),
            waiting=float(sum(len(r.waiting) for r in answered)), running=float(sum(r.running for r in answered)),
            starting=len(self.active) - len(ready), finished=float(finished),
            latency=histogram.add_buckets(*deltas), held_by_router=float(len(self.held)),
            prompt_tokens=float(prompt), output_tokens=float(output), finished_output_tokens=float(finished_output))

    def pressure(self) -> router_pressure.Pressure:
        """What the router reports on GET /pressure: held requests, requests in flight to ready replicas, ready ones."""
        ready = self.ready()
        return router_pressure.Pressure(held=float(len(self.held)), in_flight=float(sum(r.in_flight for r in ready)),
                                        ready=len(ready))

    def asleep(self) -> int:
        """Standbys loaded and asleep now (what a wake brings within wake_s)."""
        return sum(1 for loaded in self.sleepers if loaded <= self.now)

    def concurrency(self) -> float:
        """In flight at the ready replicas plus held: what Knative's queue-proxies and activator count."""
        return float(sum(r.in_flight for r in self.ready()) + len(self.held))
