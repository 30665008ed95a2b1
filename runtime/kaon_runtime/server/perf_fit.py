"""The fit behind `kaon profile` (perf_profile.py): the step-time model from a measured grid,
and its JSON within a size limit. Pure: numpy, no I/O.

step(batch, prefill tokens, context tokens) = a + b batch + c prefill + d context seconds, by
least squares, terms that come out negative refitted without (a step never gets faster with
more work). The operator's profiling Job writes the model to the container's termination
message, which the kubelet cuts at 4 KiB; `fitting` then writes it compact and, if it still
does not fit, with grid points left out evenly (the coefficients always stay).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class GridPoint:
    batch: float
    prefill_tokens: float
    context_tokens: float
    seconds: float


def fit(grid: list[GridPoint]) -> tuple[float, float, float, float]:
    """(a, b, c, d) by least squares; the slopes that come out negative are refitted without
    (measurement noise: more work never makes a step faster). When noise leaves no fixed cost
    (a <= 0), a is set to 1% of the fastest step and the slopes refitted to what remains: every
    step costs something, and the operator's model requires a > 0."""
    if len(grid) < 2:
        raise ValueError("fitting a step-time model needs at least two measured points")
    features = np.array([(1.0, p.batch, p.prefill_tokens, p.context_tokens) for p in grid])
    seconds = np.array([p.seconds for p in grid])
    terms = _nonnegative_slopes(features, seconds, [0, 1, 2, 3])
    if terms.get(0, 0.0) <= 0:
        floor = 0.01 * float(seconds.min())
        terms = {0: floor, **_nonnegative_slopes(features, seconds - floor, [1, 2, 3])}
    return terms[0], terms.get(1, 0.0), terms.get(2, 0.0), terms.get(3, 0.0)


def _nonnegative_slopes(features: np.ndarray, target: np.ndarray, keep: list[int]) -> dict[int, float]:
    """Least squares over the columns `keep`, dropping the slopes (columns but 0) that come out negative."""
    while keep:
        solved, *_ = np.linalg.lstsq(features[:, keep], target, rcond=None)
        negative = [term for term, value in zip(keep, solved) if term and value < 0]
        if not negative:
            return dict(zip(keep, solved.tolist()))
        keep = [term for term in keep if term not in negative]
    return {}


def fitting(model: dict, max_bytes: int | None) -> str:
    """The model as JSON: indented without a limit; compact within `max_bytes`, grid points
    left out evenly until it fits (ValueError when not even the coefficients do)."""
    if max_bytes is None:
        return json.dumps(model, indent=2) + "\n"
    grid = list(model.get("grid", ()))
    for kept in range(len(grid), -1, -1):
        chosen = [grid[round(i * (len(grid) - 1) / max(kept - 1, 1))] for i in range(kept)] if kept else []
        text = json.dumps({**model, "grid": chosen}, separators=(",", ":"))
        if len(text.encode()) <= max_bytes:
            return text
    raise ValueError(f"the performance model does not fit in {max_bytes} bytes")
