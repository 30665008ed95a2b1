"""Reads engine pods' /metrics (the names in ARCHITECTURE.md are the contract).

`parse` turns Prometheus text into a `PodMetrics`; `window_quantile` computes a latency
quantile over a time window from the difference of two cumulative histograms, which is
what a scrape-based autoscaler can know (the engine's histogram covers its whole life).
Only `fetch` does I/O.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

import aiohttp

LATENCY_METRICS = {"ttft": "kaon_time_to_first_token_seconds", "e2e": "kaon_e2e_request_latency_seconds"}
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)', re.M)
_LE = re.compile(r'le="([^"]+)"')
_HELD = re.compile(r'^kaon_router_held_requests\{([^}]*)\}\s+(\S+)', re.M)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True, slots=True)
class PodMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    requests_total: float = 0.0
    """All finished requests (any finish reason): the idleness signal."""
    latency_buckets: dict[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    """Per latency metric ("ttft", "e2e"): cumulative (le, count) pairs, ascending."""


def parse(text: str) -> PodMetrics:
    gauges: dict[str, float] = {}
    requests = 0.0
    buckets: dict[str, list[tuple[float, float]]] = {key: [] for key in LATENCY_METRICS}
    by_name = {f"{name}_bucket": key for key, name in LATENCY_METRICS.items()}
    for name, labels, value in _SAMPLE.findall(text):
        number = float(value)
        if name == "kaon_requests_total":
            requests += number
        elif name in by_name:
            le = _LE.search(labels or "")
            if le:
                buckets[by_name[name]].append((float(le.group(1)), number))
        else:
            gauges[name] = number
    return PodMetrics(waiting=gauges.get("kaon_num_requests_waiting", 0.0),
                      running=gauges.get("kaon_num_requests_running", 0.0),
                      kv_cache_usage=gauges.get("kaon_kv_cache_usage_ratio", 0.0), requests_total=requests,
                      latency_buckets={k: tuple(sorted(v)) for k, v in buckets.items() if v})


def parse_router_held(text: str) -> dict[tuple[str, str], float]:
    """A router's requests held per (namespace, InferenceService): they wait for a first replica."""
    held = {}
    for labels, value in _HELD.findall(text):
        named = dict(_LABEL.findall(labels))
        held[(named.get("namespace", ""), named.get("inferenceservice", ""))] = float(value)
    return held


def bucket_delta(new: tuple[tuple[float, float], ...], old: tuple[tuple[float, float], ...]
                 ) -> tuple[tuple[float, float], ...]:
    """Requests per bucket between two scrapes; a restarted engine (counts went down) counts from zero."""
    before = dict(old)
    if any(count < before.get(le, 0.0) for le, count in new):
        return new
    return tuple((le, count - before.get(le, 0.0)) for le, count in new)


def add_buckets(*histograms: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    total: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram:
            total[le] = total.get(le, 0.0) + count
    return tuple(sorted(total.items()))


def quantile(buckets: tuple[tuple[float, float], ...], q: float) -> float | None:
    """Prometheus' histogram_quantile: linear inside the bucket; None without observations.
    Past the last finite bound it answers that bound (the histogram knows no more)."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    prev_le, prev_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * (rank - prev_count) / max(count - prev_count, 1e-12)
        prev_le, prev_count = le, count
    return prev_le


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float) -> str | None:
    """One pod's /metrics text, or None when it does not answer in time (it is then left out)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            return await response.text() if response.status == 200 else None
    except (aiohttp.ClientError, TimeoutError):
        return None
