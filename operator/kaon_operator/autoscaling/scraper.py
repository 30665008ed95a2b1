"""Reads engine and router pods' /metrics (the names in the README are the contract).

`parse` turns an engine's Prometheus text (read with prometheus_client's own parser) into a
`PodMetrics` (its latency histograms as histogram.py's `Buckets`, the math on them there).
Only `fetch` does I/O.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kaon_operator.api import Key
from kaon_operator.autoscaling.histogram import Buckets

LATENCY_METRICS = {"ttft": "kaon_time_to_first_token_seconds", "e2e": "kaon_e2e_request_latency_seconds",
                   "itl": "kaon_time_per_output_token_seconds"}
_GAUGES = {"kaon_num_requests_waiting": "waiting", "kaon_num_requests_running": "running",
           "kaon_kv_cache_usage_ratio": "kv_cache_usage", "kaon_num_prompt_tokens_waiting": "prompt_tokens_waiting"}
_COUNTERS = {"kaon_prompt_tokens_total": "prompt_tokens_total",
             "kaon_generation_tokens_total": "generation_tokens_total"}


class BadExposition(ValueError):
    """The text is not Prometheus' exposition format."""


@dataclass(frozen=True, slots=True)
class PodMetrics:
    waiting: float = 0.0
    running: float = 0.0
    kv_cache_usage: float = 0.0
    prompt_tokens_waiting: float = 0.0
    """Prompt tokens not computed yet: a prefill pool's queue (0 from an engine older than the metric)."""
    requests_total: float = 0.0
    """All finished requests (any finish reason): the idleness signal."""
    prompt_tokens_total: float = 0.0
    generation_tokens_total: float = 0.0
    """With requests_total, the length mix the predictive policy sizes replicas for."""
    finished_output_tokens_total: float | None = None
    """The output lengths of all finished requests, summed (None: an engine that does not report them)."""
    latency_buckets: dict[str, Buckets] = field(default_factory=dict)
    """Per latency metric ("ttft", "e2e"): cumulative (le, count) pairs, ascending."""


def _samples(text: str):
    try:
        for family in text_string_to_metric_families(text):
            yield from family.samples
    except ValueError as exc:
        raise BadExposition(str(exc)) from None


def parse(text: str) -> PodMetrics:
    """An engine's exposition; raises BadExposition for text that is not one."""
    values = {"waiting": 0.0, "running": 0.0, "kv_cache_usage": 0.0, "prompt_tokens_waiting": 0.0,
              "requests_total": 0.0, "prompt_tokens_total": 0.0, "generation_tokens_total": 0.0}
    finished_output: float | None = None
    buckets: dict[str, list[tuple[float, float]]] = {key: [] for key in LATENCY_METRICS}
    by_name = {f"{name}_bucket": key for key, name in LATENCY_METRICS.items()}
    for sample in _samples(text):
        if sample.name == "kaon_requests_total":
            values["requests_total"] += sample.value
        elif sample.name == "kaon_request_generation_tokens_sum":
            finished_output = sample.value
        elif sample.name in _COUNTERS:
            values[_COUNTERS[sample.name]] = sample.value
        elif sample.name in by_name and "le" in sample.labels:
            buckets[by_name[sample.name]].append((float(sample.labels["le"]), sample.value))
        elif sample.name in _GAUGES:
            values[_GAUGES[sample.name]] = sample.value
    return PodMetrics(**values, finished_output_tokens_total=finished_output,
                      latency_buckets={k: tuple(sorted(v)) for k, v in buckets.items() if v})


def parse_router_held(text: str) -> dict[Key, float]:
    """A router's requests held per InferenceService: they wait for a first replica."""
    return {Key(s.labels.get("namespace", ""), s.labels.get("inferenceservice", "")): s.value
            for s in _samples(text) if s.name == "kaon_router_held_requests"}


MAX_METRICS_BYTES = 4 << 20
"""An engine's /metrics is tens of kilobytes; a pod that sends more is left out of the round, not read on."""


async def fetch(session: aiohttp.ClientSession, url: str, timeout: float,
                limit: int = MAX_METRICS_BYTES) -> str | None:
    """One pod's /metrics text, or None when it does not answer in time or sends more than
    `limit` bytes (it is then left out)."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            if response.status != 200 or (response.content_length or 0) > limit:
                return None
            body = bytearray()
            async for chunk in response.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > limit:
                    return None
            return body.decode()
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
        return None
