"""Cumulative latency histograms, as Prometheus exposes them: pure arithmetic, no I/O.

An engine's histogram covers its whole life; what a scrape-based autoscaler can know about a
time window is the difference of two scrapes (`bucket_delta`), summed over pods (`add_buckets`),
and read as Prometheus' histogram_quantile does (`quantile`, `count_above`).
"""
from __future__ import annotations

import math

Buckets = tuple[tuple[float, float], ...]
"""A cumulative histogram: (upper bound, count) pairs, ascending."""


def bucket_delta(new: Buckets, old: Buckets) -> Buckets:
    """Requests per bucket between two scrapes; a restarted engine (counts went down) counts from zero."""
    before = dict(old)
    if any(count < before.get(le, 0.0) for le, count in new):
        return new
    return tuple((le, count - before.get(le, 0.0)) for le, count in new)


def add_buckets(*histograms: Buckets) -> Buckets:
    """Several histograms (pods, windows) as one."""
    total: dict[float, float] = {}
    for histogram in histograms:
        for le, count in histogram:
            total[le] = total.get(le, 0.0) + count
    return tuple(sorted(total.items()))


def count_above(buckets: Buckets, value: float) -> float:
    """Observations above `value`, linear inside the bucket that holds it (as `quantile` assumes)."""
    if not buckets:
        return 0.0
    total, prev_le, prev_count = buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if value <= le:
            if math.isinf(le):
                return total - prev_count
            return total - (prev_count + (count - prev_count) * (value - prev_le) / max(le - prev_le, 1e-12))
        prev_le, prev_count = le, count
    return 0.0


def quantile(buckets: Buckets, q: float) -> float | None:
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
