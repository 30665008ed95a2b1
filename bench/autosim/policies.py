"""The policies judged: kaon's operator (reactive or predictive, with standbys), an HPA and Knative's KPA."""
from __future__ import annotations

import math
from collections import deque

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import autoscaler, perf_model, predictive, router_pressure, standby

from .cluster import Cluster, Scrape
from .simulation import Policy


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
