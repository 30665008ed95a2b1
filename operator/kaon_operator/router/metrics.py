"""The router's Prometheus metrics.

Counters and histograms are updated per request. Gauges are read from the router's live
state at scrape time instead, so a pod or InferenceService that is gone leaves no stale series.
"""
from __future__ import annotations

import bisect
import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import StrEnum
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, metrics as prometheus_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from kaon_operator.router.endpoints import Endpoint, EndpointTable, ServiceKey

SERVICE_LABELS = ("namespace", "inferenceservice")
ROUTE_LABELS = ("namespace", "inferenceroute")  # the kaon_route_* series (route_gateway.py)
# The goal is < 2 ms added at P99: resolution below and around it.
ADDED_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.01, 0.025, 0.05,
                         0.1, 0.25, 1.0)


class Phase(StrEnum):
    """The `phase` label of kaon_router_upstream_timeouts: which of the router's limits ran out."""

    FIRST_BYTE = "first_byte"
    """No response headers within --first-byte-timeout."""
    IDLE = "idle"
    """A response that had begun sent nothing for --idle-timeout."""


class _LiveState:
    def __init__(self, table: EndpointTable, inflight: Mapping[Endpoint, int],
                 held: Callable[[], Mapping[ServiceKey, int]], ejected: Callable[[], Iterable[Endpoint]]):
        self.table, self.inflight, self.held, self.ejected = table, inflight, held, ejected

    def collect(self):
        pods = GaugeMetricFamily("kaon_router_pod_inflight_requests", "Requests in flight to each engine pod",
                                 labels=[*SERVICE_LABELS, "pod"])
        services = GaugeMetricFamily("kaon_router_inflight_requests",
                                     "Requests in flight to each InferenceService", labels=SERVICE_LABELS)
        ready = GaugeMetricFamily("kaon_router_ready_endpoints", "Ready engine pods the router sends to",
                                  labels=SERVICE_LABELS)
        held = GaugeMetricFamily("kaon_router_held_requests",
                                 "Requests waiting for a ready pod (the InferenceService has none: scale from zero)",
                                 labels=SERVICE_LABELS)
        ejected = GaugeMetricFamily("kaon_router_ejected_endpoints",
                                    "Ready engine pods that just failed and get no new requests until their "
                                    "ejection runs out (or the watch sees them ready anew)", labels=SERVICE_LABELS)
        per_service: dict[ServiceKey, int] = {}
        targets = {e: 0 for s in self.table.services() for e in self.table.endpoints(s.key)}
        targets.update(self.inflight)  # a pod that left the table may still finish streams
        for e, count in targets.items():
            pods.add_metric([e.namespace, e.service, e.pod], count)
            key = ServiceKey(e.namespace, e.service)
            per_service[key] = per_service.get(key, 0) + count
        for s in self.table.services():
            per_service.setdefault(s.key, 0)
            ready.add_metric(list(s.key), len(self.table.endpoints(s.key)))
        for key, count in per_service.items():
            services.add_metric(list(key), count)
        waiting = self.held()
        out: dict[ServiceKey, int] = {}
        for e in self.ejected():
            key = ServiceKey(e.namespace, e.service)
            out[key] = out.get(key, 0) + 1
        for s in self.table.services():
            held.add_metric(list(s.key), waiting.get(s.key, 0))
            ejected.add_metric(list(s.key), out.get(s.key, 0))
        return [pods, services, ready, held, ejected]


class CheapHistogram:
    """An unlabelled histogram observed on every request, exposed as prometheus_client's Histogram
    exposes one (_bucket, _count, _sum), for a fraction of its cost: one bisect and two additions
    rather than a lock taken per bucket and per sum (prometheus_client's Histogram.observe was
    the costliest metrics call on the request path). The router is one event loop: no lock needed."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]):
        self.name, self.documentation = name, documentation
        self.bounds = tuple(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound (+Inf)
        self.sum = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, amount)] += 1  # le: a value on a bound counts in it
        self.sum += amount

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation)
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, float("inf")), self.counts):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        family.add_metric([], buckets, self.sum)
        return [family]


class CheapCounter:
    """A labelled counter incremented on every request, exposed as prometheus_client's Counter exposes one (`_total`
    and `_created` per series, in the order the series were first counted), for a fraction of its cost: a plain int
    per series (`series`: the label values -> [count, created]) rather than a child whose inc takes a lock (one event
    loop: none needed)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]):
        self.name, self.documentation, self.labelnames = name, documentation, tuple(labelnames)
        self.series: dict[tuple[str, ...], list[Any]] = {}

    def of(self, labels: tuple[str, ...]) -> list[Any]:
        """The [count, created] of one series, made at 0 when new (as Counter.labels makes a child)."""
        found = self.series.get(labels)
        if found is None:
            found = self.series[labels] = [0, time.time()]
        return found

    def collect(self):
        family = CounterMetricFamily(self.name, self.documentation, labels=self.labelnames)
        created = getattr(prometheus_metrics, "_use_created", True)  # PROMETHEUS_DISABLE_CREATED_SERIES, as Counter
        for labels, (count, since) in self.series.items():
            family.add_metric(labels, count, created=since if created else None)
        return [family]


class RouterMetrics:
    """One registry per router, so that tests can run several side by side."""

    def __init__(self, table: EndpointTable, inflight: Mapping[Endpoint, int],
                 held: Callable[[], Mapping[ServiceKey, int]], ejected: Callable[[], Iterable[Endpoint]] = tuple):
        self.registry = CollectorRegistry()
        self.requests = CheapCounter("kaon_router_requests", "Requests answered, by status code",
                                     [*SERVICE_LABELS, "code"])
        self.registry.register(self.requests)
        self._request_series: dict[tuple[ServiceKey | None, int], list[Any]] = {}
        self.retries = Counter("kaon_router_retries", "Attempts that failed before a response began (refused or "
                               "reset connection, upstream closed, first-byte timeout): the request went to "
                               "another pod, or got the router's error when none was left", SERVICE_LABELS,
                               registry=self.registry)
        self.timeouts = Counter("kaon_router_upstream_timeouts", "Upstream requests past a router timeout, by phase: "
                                "first_byte (no response headers in --first-byte-timeout) or idle (no stream chunk "
                                "in --idle-timeout)", [*SERVICE_LABELS, "phase"], registry=self.registry)
        self.broken = Counter("kaon_router_broken_streams", "Responses that broke off after they began (the engine "
                              "died, reset or went idle): the client got an error event or an unfinished body",
                              SERVICE_LABELS, registry=self.registry)
        self.stalled_clients = Counter("kaon_router_stalled_clients", "Responses dropped because the client took "
                                       "none of a write for --write-timeout (it stopped reading); the engine's "
                                       "request was cancelled", SERVICE_LABELS, registry=self.registry)
        self.ejections = Counter("kaon_router_ejections", "Times an engine pod was ejected after a failure",
                                 SERVICE_LABELS, registry=self.registry)
        self.added_latency = CheapHistogram(
            "kaon_router_added_latency_seconds",
            "Time the router adds: arrival to the upstream request being sent (minus time held), "
            "plus passing the response headers on", ADDED_LATENCY_BUCKETS)
        self.registry.register(self.added_latency)
        self.affinity_hits = Counter(
            "kaon_router_affinity_hits", "prefix-affinity: requests sent to their first choice (the pod holding their "
            "prefix, or the hash ring's owner of it)", SERVICE_LABELS, registry=self.registry)
        self.affinity_overrides = Counter(
            "kaon_router_affinity_overrides", "prefix-affinity: requests sent past their first choice because it "
            "carried too many requests (loadBound, no free slot, or a new conversation on a busier pod)",
            SERVICE_LABELS, registry=self.registry)
        self.held_seconds = Histogram("kaon_router_held_seconds", "Time requests waited for a ready pod",
                                      SERVICE_LABELS, registry=self.registry)
        self.overloaded = Counter("kaon_router_overloaded", "Requests and connections refused unread because a global "
                                  "limit ran out (--max-buffered-bytes, --max-connections)", registry=self.registry)
        self.registry.register(_LiveState(table, inflight, held, ejected))

    def count(self, key: ServiceKey | None, status: int) -> None:
        """A request answered (None: before it named a known InferenceService)."""
        # The series is looked up once per (service, status): its labels are made once. No series is ever removed, so
        # a kept one stays the counter's.
        series = self._request_series.get((key, status))
        if series is None:
            series = self._request_series[(key, status)] = self.requests.of((*(key or ("", "")), str(status)))
        series[0] += 1

    def render(self, shown: Callable[[ServiceKey], bool] | None = None,
               route_shown: Callable[[str, str], bool] = lambda namespace, name: True) -> bytes:
        """The exposition; with `shown`, only the series about an InferenceService it accepts (and
        those about none), and about an InferenceRoute `route_shown` accepts: the router's open port
        must not name protected services, their pods or keyed routes."""
        if shown is None:
            return generate_latest(self.registry)
        return generate_latest(_Only(self.registry, shown, route_shown))


class _Only:
    """A registry's series, less those about the InferenceServices `shown` refuses and the
    InferenceRoutes `route_shown` refuses."""

    def __init__(self, registry: CollectorRegistry, shown: Callable[[ServiceKey], bool],
                 route_shown: Callable[[str, str], bool]):
        self.registry, self.shown, self.route_shown = registry, shown, route_shown

    def _keep(self, labels: Mapping[str, str]) -> bool:
        route = [labels.get(label) for label in ROUTE_LABELS]
        if all(route):
            return self.route_shown(*route)  # type: ignore[arg-type]
        names = [labels.get(label) for label in SERVICE_LABELS]
        return not all(names) or self.shown(ServiceKey(*names))  # type: ignore[arg-type]

    def collect(self):
        for family in self.registry.collect():
            kept = copy.copy(family)
            kept.samples = [s for s in family.samples if self._keep(s.labels)]
            yield kept
