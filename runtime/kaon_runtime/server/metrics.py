"""Prometheus metrics of one engine server.

The names are a contract: the autoscaler and the router read them (see ARCHITECTURE.md).
Engine-wide figures (queue lengths, KV usage, token and prefix-cache counters) are read from
the engine's own counters at scrape time; per-request latencies are observed by the server
as each request ends. Each app gets its own registry, so several apps (tests) can coexist.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kaon_runtime.engine import startup
from kaon_runtime.engine.kv_tiers import TierStats
from kaon_runtime.engine.llm_engine import EngineStats
from kaon_runtime.engine.outputs import RequestOutput

# From a millisecond (a cached short prompt on a GPU) to ten minutes (a long CPU generation).
# Fine between 1 and 10 s, where TTFT and end-to-end SLOs live: the autoscaler interpolates a
# P99 inside a bucket, and a 4 s target inside (2.5, 5] would read a 2.6 s P99 as over it.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0,
                   1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
OUTPUT_LENGTH_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats]):
        self._stats = stats

    def collect(self):
        s = self._stats()
        yield GaugeMetricFamily("kaon_num_requests_running", "Sequences being decoded or prefilled.",
                                value=s.num_running)
        yield GaugeMetricFamily("kaon_num_requests_waiting", "Sequences waiting for admission.",
                                value=s.num_waiting)
        yield GaugeMetricFamily("kaon_num_prompt_tokens_waiting",
                                "Prompt tokens not computed yet (waiting or mid-prefill): a prefill pool's queue.",
                                value=s.prompt_tokens_waiting)
        yield GaugeMetricFamily("kaon_kv_cache_usage_ratio", "Share of KV cache blocks in use (0..1).",
                                value=s.kv_cache_usage)
        yield GaugeMetricFamily("kaon_kv_cache_capacity_tokens", "Tokens the KV cache holds (blocks x block size).",
                                value=s.kv_cache_tokens)
        yield CounterMetricFamily("kaon_prompt_tokens_total", "Prompt tokens accepted.", value=s.prompt_tokens)
        yield CounterMetricFamily("kaon_generation_tokens_total", "Tokens generated.", value=s.generation_tokens)
        yield CounterMetricFamily("kaon_prefix_cache_queries_total",
                                  "Prompt tokens looked up in the prefix cache, once per admission.",
                                  value=s.prefix_cache_queries)
        yield CounterMetricFamily("kaon_prefix_cache_hits_total", "Prompt tokens served from the prefix cache.",
                                  value=s.prefix_cache_hits)
        # accepted / draft is the speculative acceptance rate; both stay 0 without speculation.
        yield CounterMetricFamily("kaon_spec_decode_draft_tokens_total", "Speculative tokens drafted and verified.",
                                  value=s.spec_draft_tokens)
        yield CounterMetricFamily("kaon_spec_decode_accepted_tokens_total",
                                  "Speculative tokens the target model kept.", value=s.spec_accepted_tokens)
        if s.kv_tiers is not None:
            yield from kv_tier_metrics(s.kv_tiers)


def kv_tier_metrics(t: TierStats):
    """`kaon_kv_tier_*`: the host and disk tiers below the pool (engine/kv_tiers.py)."""
    size = GaugeMetricFamily("kaon_kv_tier_bytes", "Bytes of KV blocks a tier holds.", labels=["tier"])
    capacity = GaugeMetricFamily("kaon_kv_tier_capacity_bytes", "Bytes a tier may hold.", labels=["tier"])
    for tier, held, cap in (("host", t.host_bytes, t.host_capacity_bytes), ("disk", t.disk_bytes,
                                                                           t.disk_capacity_bytes)):
        size.add_metric([tier], held)
        capacity.add_metric([tier], cap)
    hits = CounterMetricFamily("kaon_kv_tier_hits_total", "Prefix blocks brought back into the pool from a tier.",
                               labels=["tier"])
    for tier, n in t.hits.items():
        hits.add_metric([tier], n)
    moved = CounterMetricFamily("kaon_kv_tier_blocks_moved_total", "Blocks copied between the pool and the tiers.",
                                labels=["direction"])
    seconds = CounterMetricFamily("kaon_kv_tier_seconds_total", "Time spent copying blocks, by direction (off the "
                                  "engine's step except *_to_pool).", labels=["direction"])
    for direction, n in t.moved.items():
        moved.add_metric([direction], n)
        seconds.add_metric([direction], t.seconds.get(direction, 0.0))
    discarded = CounterMetricFamily("kaon_kv_tier_copies_discarded_total", "Copies down voided because the pool reused "
                                    "their block first.", value=t.discarded)
    yield from (size, capacity, hits, moved, seconds, discarded)


class _StartupCollector(Collector):
    def collect(self):
        found = startup.seconds()
        family = GaugeMetricFamily("kaon_startup_seconds", "Seconds this engine's start-up took, by phase "
                                   "(import, fetch, load, kv_allocation, warmup; engine/startup.py).", labels=["phase"])
        for name in startup.PHASES:
            if name in found:
                family.add_metric([name], found[name])
        yield family


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats]):
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.registry.register(_StartupCollector())
        self.ttft = Histogram("kaon_time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("kaon_time_per_output_token_seconds", "Mean time between output tokens of a request.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("kaon_e2e_request_latency_seconds", "Arrival to the end of the request.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.requests = Counter("kaon_requests_total", "Requests ended, by finish reason.", ["finish_reason"],
                                registry=self.registry)
        # Its _sum over _count is the mean output of the requests that ended: the predictive
        # autoscaler's length mix (generated tokens lag arrivals while a load rises).
        self.output_lengths = Histogram("kaon_request_generation_tokens", "Tokens generated per request, at its end.",
                                        buckets=OUTPUT_LENGTH_BUCKETS, registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def track(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Times one request from arrival; `finish` records it exactly once."""

    def __init__(self, metrics: Metrics):
        self._metrics = metrics
        self._arrival = time.perf_counter()
        self._first_token: float | None = None
        self._done = False

    def observe(self, output: RequestOutput) -> None:
        if self._first_token is None and any(c.token_ids for c in output.outputs):
            self._first_token = time.perf_counter()
            self._metrics.ttft.observe(self._first_token - self._arrival)

    def finish(self, output: RequestOutput | None, aborted: bool = False) -> None:
        if self._done:
            return
        self._done = True
        now = time.perf_counter()
        self._metrics.e2e.observe(now - self._arrival)
        reason = "abort" if aborted or output is None else (output.outputs[0].finish_reason or "abort")
        self._metrics.requests.labels(finish_reason=reason).inc()
        num_tokens = max((len(c.token_ids) for c in output.outputs), default=0) if output else 0
        self._metrics.output_lengths.observe(num_tokens)
        if self._first_token is not None and num_tokens > 1:
            self._metrics.tpot.observe((now - self._first_token) / (num_tokens - 1))
