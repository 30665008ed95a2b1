"""A calibrated discrete-event simulator that judges kaon's autoscaling policy.

    python bench/autoscale_sim.py [--json] [--plot DIR] [--traces steady-60 step ...]
    python bench/autoscale_sim.py --calibrate          # measure the engine here first
    python bench/autoscale_sim.py --step-ms 12,0.3,0.02 --cold-start-s 180   # GPU figures

Engine (one object per replica): at most maxNumSeqs sequences run; every step decodes one
token for each running sequence and prefills prompt chunks first-come-first-served within
maxNumBatchedTokens (decodes count against that budget, as in kaon's scheduler); the step
takes a + b * decode_batch + c * prefill_tokens seconds (fitted by --calibrate from a real
`kaon serve`); waiting requests queue FIFO at the replica; a request's first token comes at
the end of the step that finishes its prompt (TTFT = queueing + prefill).

Cluster: the router sends each request to the ready replica with the fewest requests in
flight, and holds requests while no replica is ready (until one is, or the hold timeout).
A new replica is ready after the cold start. A removed replica takes no new requests and
drains; what is still in flight after the drain grace period is cut (and counted).

Policies, on the same trace and seed: kaon (`kaon_operator.autoscaling.autoscaler.decide` fed the very
`Sample`s the operator builds, every 5 s), an HPA-style policy, Knative's KPA and an oracle
(see `oracle_schedule`); kaon-standby is the predictive policy with standby replicas (issue 53):
`--standby` of them loaded and asleep, a scale-up waking one (the profiled wake, `Wake`: the engine's,
the readiness probe's phase, the routers' watch, the standby loop's round; or a constant `--wake-s`) and
starting another behind it, each costing `--standby-cost` of an awake replica in its replica-hours.
The yardstick: SLO attainment (TTFT <= target), replica-hours
relative to the oracle, replica changes per hour, requests cut by scale-down.
"""
from __future__ import annotations

import argparse
import ast
import bisect
import heapq
import json
import math
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "operator"))

from kaon_operator.api import AutoscalingSpec  # noqa: E402
from kaon_operator.autoscaling import autoscaler, histogram, perf_model, predictive, router_pressure, standby  # noqa: E402

CALIBRATION = ROOT / "bench" / "data" / "autoscale_calibration.json"
MAX_REPLICAS = 10
HPA_FRONTIER = (0.5, 0.6, 0.7, 0.8, 0.9)
"""The HPA run again at these shares of its target: its replica-hours for each SLO it can
reach, so that kaon is compared with the cheapest HPA setting at kaon's SLO or better (one
HPA target is one point; at another SLO it is not the policy a user would have tuned)."""


def policy_version() -> str:
    """The git blob hash of the autoscaler.py this run imported (its owner edits it): say which policy was judged."""
    import hashlib
    data = Path(autoscaler.__file__).read_bytes()
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()[:10]


def _engine_buckets() -> tuple[float, ...]:
    """The engine's TTFT histogram bounds, read from its source (importing it pulls in torch)."""
    tree = ast.parse((ROOT / "runtime" / "kaon_runtime" / "server" / "metrics.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "LATENCY_BUCKETS" for t in node.targets):
            return tuple(ast.literal_eval(node.value))
    raise RuntimeError("LATENCY_BUCKETS not found in metrics.py")


BUCKETS = _engine_buckets()
BOUNDS = (*BUCKETS, math.inf)  # Prometheus adds the +Inf bucket


# --------------------------------------------------------------------------- the engine model

@dataclass(frozen=True)
class EngineModel:
    a: float
    """Seconds every step costs (the engine loop, the weights read once per step)."""
    b: float
    """Seconds per decoding sequence in the step."""
    c: float
    """Seconds per prompt token prefilled in the step."""
    cold_start_s: float
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 1024
    d: float = 0.0
    """Seconds per context token (prompt and generated so far) of the decoding sequences."""

    def step_seconds(self, batch: int, prefill_tokens: int, context_tokens: float = 0.0) -> float:
        return self.a + self.b * batch + self.c * prefill_tokens + self.d * context_tokens

    def perf_model(self) -> perf_model.PerfModel:
        """What a profile of this engine measures: the predictive policy's model."""
        return perf_model.PerfModel(self.a, self.b, self.c, self.d, cold_start_seconds=self.cold_start_s,
                                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens)


@dataclass(frozen=True)
class Workload:
    """Prompt and output lengths, uniform in these inclusive ranges."""
    prompt: tuple[int, int] = (32, 256)
    output: tuple[int, int] = (16, 128)

    def mean(self) -> tuple[float, float]:
        return sum(self.prompt) / 2, sum(self.output) / 2


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


# --------------------------------------------------------------------------- requests and replicas

class Request:
    __slots__ = ("arrival", "prompt", "output", "todo", "first_token", "done", "cut", "failed")

    def __init__(self, arrival: float, prompt: int, output: int):
        self.arrival, self.prompt, self.output = arrival, prompt, output
        self.todo = prompt  # prompt tokens not prefilled yet
        self.first_token: float | None = None
        self.done: float | None = None
        self.cut = False
        self.failed = False  # held at the router past the hold timeout

    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival


class Replica:
    """One engine: a FIFO queue, sequences in prefill, sequences in decode, its counters."""

    def __init__(self, rid: int, ready_at: float):
        self.id, self.ready_at = rid, ready_at
        self.waiting: deque[Request] = deque()
        self.prefilling: deque[Request] = deque()
        self.decoding: list[tuple[int, int, Request]] = []  # heap of (step it finishes at, tie, request)
        self.steps = 0
        self.stepping = False
        self.chunks: list[tuple[Request, int]] = []  # the prefill chunks of the step in flight
        self.draining_since: float | None = None
        self.gone = False
        self.finished = 0  # requests finished: the engine's kaon_requests_total
        self.prompt_tokens = 0  # kaon_prompt_tokens_total: counted when a request is accepted
        self.generated = 0  # kaon_generation_tokens_total
        self.finished_output = 0  # kaon_request_generation_tokens_sum: the output lengths of finished requests
        self.context_base = 0  # sum over decoding sequences of prompt + output - the step they finish at
        self.ttft_counts = [0] * len(BOUNDS)  # per bucket (not cumulative)

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    @property
    def in_flight(self) -> int:
        return len(self.waiting) + self.running

    def histogram(self) -> tuple[tuple[float, float], ...]:
        """The cumulative (le, count) pairs a scrape of kaon_time_to_first_token_seconds reads."""
        total, out = 0, []
        for le, count in zip(BOUNDS, self.ttft_counts):
            total += count
            out.append((le, float(total)))
        return tuple(out)

    def plan_step(self, model: EngineModel) -> float:
        """Choose this step's work as kaon's scheduler does; return its duration."""
        budget = model.max_num_batched_tokens - len(self.decoding)
        chunks = []
        for req in self.prefilling:
            if budget <= 0:
                break
            n = min(req.todo, budget)
            chunks.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.running < model.max_num_seqs:
            req = self.waiting.popleft()
            self.prefilling.append(req)
            n = min(req.todo, budget)
            chunks.append((req, n))
            budget -= n
        self.chunks = chunks
        context = self.context_base + len(self.decoding) * self.steps if model.d else 0.0
        return model.step_seconds(len(self.decoding), sum(n for _, n in chunks), context)

    def finish_step(self, now: float) -> list[Request]:
        """Apply the step that ends now; return the requests it finished."""
        self.generated += len(self.decoding)
        self.steps += 1
        done = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            end, _, req = heapq.heappop(self.decoding)
            self.context_base -= req.prompt + req.output - end
            done.append(req)
        for req, n in self.chunks:
            req.todo -= n
            if req.todo == 0:
                self.prefilling.remove(req)
                req.first_token = now
                self.generated += 1
                self.ttft_counts[bisect.bisect_left(BOUNDS, now - req.arrival)] += 1
                if req.output <= 1:
                    done.append(req)
                else:
                    end = self.steps + req.output - 1
                    heapq.heappush(self.decoding, (end, id(req), req))
                    self.context_base += req.prompt + req.output - end
        self.chunks = []
        for req in done:
            req.done = now
            self.finished_output += req.output
        self.finished += len(done)
        return done


# --------------------------------------------------------------------------- the cluster

@dataclass
class Scrape:
    """Per-policy scrape state: the per-pod baselines survive pods missing a scrape."""
    failure_p: float
    rng: random.Random
    finished: dict[int, int] = field(default_factory=dict)
    tokens: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    latency: dict[int, tuple[tuple[float, float], ...]] = field(default_factory=dict)


@dataclass
class Wake:
    """From a standby's wake ordered to it taking requests, part by part (issue 53: "wake times from the profile").

    A constant `--wake-s X` is `Wake(engine_s=X)` (what every standby run before the profiled wake used). The
    profiled wake (`PROFILED`, the default) holds, each part measured or stated in bench/history/sleep_wake.md:
    - engine_s: POST /wake_up to /ready at the level standbys sleep at (standby.SLEEP_LEVEL, level 1), plus the
      first answer's extra time after a wake against one when awake (bench/sleep_wake.py);
    - probe_period_s: the kubelet reads /ready every STANDBY_READINESS_PERIOD_SECONDS on its own phase, so the
      pod turns Ready uniformly 0..period after the engine does (drawn, not its mean);
    - ready_to_router_s: the pod's Ready condition written by the kubelet and seen by the routers' pod watch
      (router/watch.py: the routers watch pods, not Endpoints);
    - round_s: a wake the regular policy orders (spec.replicas written) waits for the standby loop's next round
      (standby_sync.INTERVAL_SECONDS), uniformly 0..round; the pressure loop wakes in the same breath (its own
      latency is Poke.latency_s), so a poked wake skips it.
    """
    engine_s: float = 0.0
    probe_period_s: float = 0.0
    ready_to_router_s: float = 0.0
    round_s: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0), compare=False, repr=False)

    def round_delay(self, poked: bool) -> float:
        """The wait for the standby loop's round: one draw per scale-up (one round wakes every standby it needs)."""
        return self.rng.uniform(0.0, self.round_s) if self.round_s and not poked else 0.0

    def seconds(self, round_delay: float = 0.0) -> float:
        """One pod's wake after its round: the fixed parts and its own probe phase (no draw when the period is 0,
        so a constant wake draws nothing)."""
        probe = self.rng.uniform(0.0, self.probe_period_s) if self.probe_period_s else 0.0
        return round_delay + self.engine_s + probe + self.ready_to_router_s

    def mean(self, poked: bool = False) -> float:
        return self.engine_s + self.ready_to_router_s + self.probe_period_s / 2 + (0.0 if poked else self.round_s / 2)

    def describe(self) -> str:
        if not (self.probe_period_s or self.ready_to_router_s or self.round_s):
            return f"a wake takes {self.engine_s:g} s"
        return (f"a wake takes {self.engine_s:g} s (engine) + {self.ready_to_router_s:g} s (Ready to the routers) + "
                f"U(0, {self.probe_period_s:g}) s (readiness probe) + U(0, {self.round_s:g}) s (standby loop's round, "
                f"regular scale-ups only): mean {self.mean():.2f} s, {self.mean(poked=True):.2f} s on a poke")


ENGINE_WAKE_S = 0.21
"""kaon serve of the bundled model (CPU), POST /wake_up to /ready from level 1, median of 10 (max 0.23 s), plus the
first answer's extra after it (+0.001 s): bench/sleep_wake.py, 2026-11-30 17:22 UTC, load 0.5-1.2
(bench/history/sleep_wake.md)."""
READY_TO_ROUTER_S = 0.1
"""The kubelet's status write and the routers' watch event: an estimate (the apiserver's part measured 8 ms median,
47 ms max on the local control plane, bench/pod_ready_watch.py; the kubelet's part not), history/sleep_wake.md."""
PROFILED = Wake(ENGINE_WAKE_S, probe_period_s=standby.STANDBY_READINESS_PERIOD_SECONDS,
                ready_to_router_s=READY_TO_ROUTER_S, round_s=2.0)
"""The profiled wake (the default): round_s is standby_sync.INTERVAL_SECONDS (the simulator does not import the
operator's I/O modules; tests/unit/bench/test_autoscale_sim.py checks the two agree)."""


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


# --------------------------------------------------------------------------- policies

class Policy:
    name = "policy"
    period = 5.0

    def decide(self, cluster: Cluster) -> int:
        raise NotImplementedError

    def poked(self, cluster: Cluster, pressure: router_pressure.Pressure) -> int | None:
        """What the policy does with the routers' report (kaon with standbys: router_pressure.py); None: nothing."""
        return None


class Kaon(Policy):
    """kaon's operator: a scrape every 5 s into a history, `decide` on it: the reactive policy
    (autoscaler.py), or with a performance model the predictive one (predictive.py)."""
    name = "kaon-reactive"
    period = 5.0

    def __init__(self, spec: AutoscalingSpec, max_num_seqs: int, scrape: Scrape,
                 model: perf_model.PerfModel | None = None, name: str | None = None):
        self.spec, self.max_num_seqs, self.state, self.model = spec, max_num_seqs, scrape, model
        self.history: list[autoscaler.Sample] = []
        self.keep = autoscaler.history_seconds(spec)
        if model is not None:
            self.name = "kaon-predictive"
        self.name = name or self.name

    def decide(self, cluster: Cluster) -> int:
        now = cluster.now
        self.history.append(cluster.scrape(self.state))
        while self.history and self.history[0].time < now - self.keep:
            self.history.pop(0)
        if self.model is not None:
            decision = predictive.decide(self.history, self.spec, len(cluster.active), now, cluster.last_change,
                                         model=self.model, max_num_seqs=self.max_num_seqs)
            return standby.from_zero(decision, self.spec, len(cluster.active)).replicas
        return autoscaler.decide(self.history, self.spec, len(cluster.active), now, cluster.last_change,
                                 max_num_seqs=self.max_num_seqs).replicas

    def poked(self, cluster: Cluster, pressure: router_pressure.Pressure) -> int | None:
        """The operator's pressure loop: the same pure decision (router_pressure.decide) on what the router reported."""
        decision = router_pressure.decide(pressure, self.spec, len(cluster.active), cluster.asleep(),
                                          self.max_num_seqs)
        return None if decision is None else decision.replicas


class HPA(Policy):
    """Kubernetes HPA on the average in-flight requests per ready pod (running + waiting)."""
    name = "hpa"
    period = 15.0  # --horizontal-pod-autoscaler-sync-period
    TOLERANCE = 0.1
    STABILIZATION_S = 300.0

    def __init__(self, target: float, min_replicas: int, max_replicas: int, scrape: Scrape, name: str = "hpa"):
        self.target, self.min, self.max, self.state = target, max(1, min_replicas), max_replicas, scrape
        self.name = name
        self.recommendations: deque[tuple[float, int]] = deque()

    def recommend(self, cluster: Cluster) -> int:
        current = len(cluster.active)
        ready = cluster.ready()
        answered = [r for r in ready if self.state.rng.random() >= self.state.failure_p]
        if not answered:
            return current  # no metrics: HPA leaves the scale alone
        usage = [float(r.in_flight) for r in answered]
        ratio = sum(usage) / len(usage) / self.target
        missing = len(ready) - len(answered)
        if missing:  # HPA: missing pods count as 0 on a scale-up, as at target on a scale-down
            usage += [0.0 if ratio > 1 else self.target] * missing
            ratio = sum(usage) / len(usage) / self.target
        if abs(ratio - 1) <= self.TOLERANCE:
            return current
        return math.ceil(ratio * len(usage))

    def decide(self, cluster: Cluster) -> int:
        now, current = cluster.now, len(cluster.active)
        if not self.recommendations:  # a fresh controller: the scale it finds is its first recommendation
            self.recommendations.append((now, current))
        self.recommendations.append((now, self.recommend(cluster)))
        while self.recommendations[0][0] < now - self.STABILIZATION_S:
            self.recommendations.popleft()
        wanted = self.recommendations[-1][1]
        if wanted < current:  # scale down to the highest recommendation of the window
            wanted = min(current, max(r for _, r in self.recommendations))
        wanted = min(wanted, max(2 * current, current + 4))  # scale-up policies: double or +4 per 15 s
        return max(self.min, min(self.max, wanted))


class KPA(Policy):
    """Knative's KPA: concurrency averaged over a 60 s stable and a 6 s panic window."""
    name = "kpa"
    period = 1.0  # concurrency is sampled every second, decided every 2 s (Knative's tick)
    STABLE_S, PANIC_S, TICK_S = 60.0, 6.0, 2.0
    PANIC_THRESHOLD = 2.0
    MAX_SCALE_DOWN_RATE = 2.0
    SCALE_TO_ZERO_GRACE_S = 30.0

    def __init__(self, container_concurrency: int, min_replicas: int, max_replicas: int, scrape: Scrape,
                 utilization: float = 0.7):
        self.target = container_concurrency * utilization
        self.min, self.max, self.state = min_replicas, max_replicas, scrape
        self.samples: deque[tuple[float, float]] = deque()
        self.panic_since: float | None = None
        self.panic_floor = 0
        self.last_traffic = 0.0
        self.started: float | None = None

    def observe(self, cluster: Cluster) -> float:
        """The service's concurrency; pods that miss the scrape are extrapolated from the others."""
        ready = cluster.ready()
        answered = [r for r in ready if self.state.rng.random() >= self.state.failure_p]
        seen = sum(r.in_flight for r in answered)
        scale = len(ready) / len(answered) if answered else 0.0
        return seen * scale + len(cluster.held)

    def decide(self, cluster: Cluster) -> int:
        now, current = cluster.now, len(cluster.active)
        self.started = now if self.started is None else self.started
        concurrency = self.observe(cluster)
        self.samples.append((now, concurrency))
        while self.samples[0][0] <= now - self.STABLE_S:
            self.samples.popleft()
        if concurrency > 0:
            self.last_traffic = now
        if round(now) % self.TICK_S:
            return current
        stable = sum(c for _, c in self.samples) / len(self.samples)
        recent = [c for t, c in self.samples if t > now - self.PANIC_S]
        panic = sum(recent) / len(recent)
        want_stable, want_panic = math.ceil(stable / self.target), math.ceil(panic / self.target)
        ready = len(cluster.ready())
        if want_panic >= self.PANIC_THRESHOLD * max(ready, 1) and want_panic > 0:
            if self.panic_since is None:
                self.panic_floor = current
            self.panic_since = now  # every tick with reason to panic extends it
        elif self.panic_since is not None and now - self.panic_since >= self.STABLE_S:
            self.panic_since = None
        if self.panic_since is not None:  # in panic: never down
            self.panic_floor = max(self.panic_floor, want_panic)
            wanted = self.panic_floor
        else:
            wanted = max(want_stable, math.floor(ready / self.MAX_SCALE_DOWN_RATE))
            if now - self.started < self.STABLE_S:  # a fresh autoscaler fills its window before going down
                wanted = max(wanted, current)
        if now - self.last_traffic < self.STABLE_S + self.SCALE_TO_ZERO_GRACE_S:
            wanted = max(wanted, 1)  # to zero only after a stable window without traffic, plus grace
        return max(self.min, min(self.max, wanted))


class Schedule(Policy):
    """Replicas per minute from a precomputed list (the oracle)."""
    name = "oracle"
    period = 60.0

    def __init__(self, per_minute: list[int], name: str = "oracle"):
        self.per_minute, self.name = per_minute, name

    def decide(self, cluster: Cluster) -> int:
        return self.per_minute[min(int(cluster.now // 60), len(self.per_minute) - 1)]


# --------------------------------------------------------------------------- one run

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


# --------------------------------------------------------------------------- the oracle

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


# --------------------------------------------------------------------------- traces

@dataclass(frozen=True)
class Trace:
    name: str
    duration: float
    rate: Callable[[float], float]  # requests/s at time t
    min_replicas: int = 1
    steady: bool = False
    workload: Callable[[float], Workload] | None = None
    """The length mix at time t (None: the run's workload throughout)."""


LONG_PROMPTS = Workload(prompt=(96, 416))  # long-context traffic: a mean prompt 1.8x the default's


def cached_oracle_schedule(cache: Path | None, arrivals: list[tuple[float, int, int]], duration: float,
                           model: EngineModel, workload: Workload, target: float, min_replicas: int) -> list[int]:
    """oracle_schedule, kept in `cache` (a folder; None: computed every time). The oracle depends only on the
    trace's arrivals, the engine model and this file (never on a policy), and it is most of a run's time
    (minutes per trace and seed on a loaded 2-vCPU machine), so runs that judge policy variants reuse it.
    The key hashes the inputs and this file's text, so an edit to the simulator computes it afresh."""
    if cache is None:
        return oracle_schedule(arrivals, duration, model, workload, target, min_replicas)
    import hashlib
    key = hashlib.sha256(Path(__file__).read_bytes()
                         + repr((arrivals, duration, model, workload, target, min_replicas)).encode()).hexdigest()
    path = cache / f"oracle-{key[:32]}.json"
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


def traces(per_replica: float, seed: int, minutes: float = 90.0) -> list[Trace]:
    """Rates in units of one replica's full-batch capacity (three replicas = 3.0)."""
    c = per_replica
    d = minutes * 60.0
    rng = random.Random(seed + 1)
    bursts, t = [], rng.expovariate(1 / 600.0)  # Poisson bursts: one every 10 minutes on average
    while t < d:
        bursts.append(t)
        t += rng.expovariate(1 / 600.0)

    def bursty(x: float) -> float:
        return c * (0.9 + (2.1 if any(b <= x < b + 120.0 for b in bursts) else 0.0))

    def idle_burst(x: float) -> float:  # idle, a burst, idle, a burst, idle
        minute = x / 60.0 * 90.0 / minutes
        return c * 1.8 if 20 <= minute < 35 or 60 <= minute < 75 else 0.0

    def daily(x: float) -> float:  # a working day: a slow rise, a lunchtime burst, a slow fall
        day = x / d
        lunch = 1.2 if 0.45 <= day < 0.55 else 0.0
        return c * (0.3 + 2.0 * math.sin(math.pi * day) ** 2 + lunch)

    def mix(x: float) -> Workload:  # the same request rate; long prompts in the middle third
        return LONG_PROMPTS if d / 3 <= x < 2 * d / 3 else Workload()

    return [
        Trace("steady-30", d, lambda x: 0.9 * c, steady=True),
        Trace("steady-60", d, lambda x: 1.8 * c, steady=True),
        Trace("steady-90", d, lambda x: 2.7 * c, steady=True),
        Trace("step", d, lambda x: c * (2.7 if d / 3 <= x < 2 * d / 3 else 0.6)),
        Trace("ramp", d, lambda x: c * (0.3 + 3.3 * min(x / (2 * d / 3), 1.0 - max(0.0, x - 2 * d / 3) / (d / 3)))),
        Trace("diurnal", d, lambda x: c * (2.0 - 1.7 * math.cos(2 * math.pi * x / d))),
        Trace("bursts", d, bursty),
        Trace("idle-burst", d, idle_burst, min_replicas=0),
        Trace("mix-shift", d, lambda x: 1.2 * c, workload=mix),
        Trace("daily", d, daily),
    ]


def arrivals_for(trace: Trace, workload: Workload, seed: int) -> list[tuple[float, int, int]]:
    """Poisson arrivals at the trace's rate (piecewise constant per second), with lengths."""
    rng = random.Random(seed)
    out = []
    for second in range(int(trace.duration)):
        lam = trace.rate(second + 0.5)
        if lam <= 0:
            continue
        mix = trace.workload(second + 0.5) if trace.workload else workload
        t = second + rng.expovariate(lam)
        while t < second + 1:
            out.append((t, rng.randint(*mix.prompt), rng.randint(*mix.output)))
            t += rng.expovariate(lam)
    return out


# --------------------------------------------------------------------------- the whole run

@dataclass
class Config:
    model: EngineModel
    workload: Workload = Workload()
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


# --------------------------------------------------------------------------- output

def iso_slo(rows: list[dict], policy: str = "kaon-predictive") -> list[dict]:
    """Per trace: `policy` against the cheapest HPA setting (the frontier's and the default
    target) whose SLO attainment is at least as good; None where no HPA setting reaches it."""
    out = []
    for trace in dict.fromkeys(r["trace"] for r in rows):
        ours = next(r for r in rows if r["trace"] == trace and r["policy"] == policy)
        hpas = [r for r in rows if r["trace"] == trace and (r["policy"] == "hpa" or r["policy"].startswith("hpa-x"))]
        good = [r for r in hpas if r["slo_attainment"] >= ours["slo_attainment"]]
        best = min(good, key=lambda r: r["replica_hours"], default=None)
        out.append({"trace": trace, "policy": policy, "slo_attainment": ours["slo_attainment"],
                    "replica_hours": ours["replica_hours"], "hpa_setting": best and best["policy"],
                    "hpa_slo_attainment": best and best["slo_attainment"],
                    "hpa_replica_hours": best and best["replica_hours"],
                    "below_hpa": best is None or ours["replica_hours"] < best["replica_hours"]})
    return out


def iso_table(rows: list[dict]) -> str:
    head = f"{'trace':11} {'SLO att.':>9} {'repl-h':>7}   {'cheapest HPA at that SLO or better':36} {'below':>5}"
    lines = [head, "-" * len(head)]
    for r in rows:
        hpa = "none reaches it" if r["hpa_setting"] is None else \
            f"{r['hpa_setting']}: {100 * r['hpa_slo_attainment']:.2f}%, {r['hpa_replica_hours']:.2f} h"
        lines.append(f"{r['trace']:11} {100 * r['slo_attainment']:8.2f}% {r['replica_hours']:7.2f}   {hpa:36} "
                     f"{'yes' if r['below_hpa'] else 'no':>5}")
    return "\n".join(lines)


def table(rows: list[dict], target: float) -> str:
    head = (f"{'trace':11} {'policy':16} {'SLO att.':>9} {'repl-h':>7} {'vs oracle':>9} {'vs dwell':>8} {'chg/h':>6} "
            f"{'cut':>5} {'503':>4} {'P99 TTFT':>9} {'requests':>8}")
    lines = [f"TTFT target {target:g} s", head, "-" * len(head)]
    for r in rows:
        vs = "-" if r["replica_hours_vs_oracle"] is None else f"{r['replica_hours_vs_oracle']:.2f}x"
        dwell = "-" if r["replica_hours_vs_dwell_oracle"] is None else f"{r['replica_hours_vs_dwell_oracle']:.2f}x"
        lines.append(f"{r['trace']:11} {r['policy']:16} {100 * r['slo_attainment']:8.2f}% {r['replica_hours']:7.2f} "
                     f"{vs:>9} {dwell:>8} {r['changes_per_hour']:6.1f} {r['cut_requests']:5d} {r['failed_held']:4d} "
                     f"{r['p99_ttft_s']:8.2f}s {r['requests']:8d}")
    return "\n".join(lines)


def plot(series: dict, target: float, out: Path) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace, arrivals, runs = series["trace"], series["arrivals"], series["runs"]
    minutes = math.ceil(trace.duration / 60)
    fig, (ax_load, ax_rep, ax_p99) = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    per_minute = [0] * minutes
    for t, _, _ in arrivals:
        per_minute[min(int(t // 60), minutes - 1)] += 1
    ax_load.plot(range(minutes), [n / 60 for n in per_minute], color="black", drawstyle="steps-post")
    ax_load.set_ylabel("arrivals (req/s)")
    ax_load.set_title(f"{trace.name}: load, replicas, P99 TTFT per minute")
    for name, run in runs.items():
        if name.startswith("hpa-x"):  # the HPA frontier is a table, not eight more lines
            continue
        log = run.replica_log + [(trace.duration, run.replica_log[-1][1])]
        ax_rep.plot([t / 60 for t, _ in log], [n for _, n in log], drawstyle="steps-post", label=name,
                    linestyle="--" if name.startswith("oracle") else "-")
        p99 = []
        for m in range(minutes):
            ttfts = [r.ttft() for r in run.requests if m * 60 <= r.arrival < (m + 1) * 60 and r.ttft() is not None]
            p99.append(percentile(ttfts, 0.99) if ttfts else float("nan"))
        ax_p99.plot(range(minutes), p99, label=name, linestyle="--" if name.startswith("oracle") else "-")
    ax_rep.set_ylabel("replicas")
    ax_rep.legend(loc="upper left", fontsize=8)
    ax_p99.axhline(target, color="red", linewidth=1, label="target")
    ax_p99.set_yscale("log")
    ax_p99.set_ylabel("P99 TTFT (s)")
    ax_p99.set_xlabel("minute")
    ax_p99.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"autoscale_{trace.name}.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


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


if __name__ == "__main__":
    sys.exit(main())
