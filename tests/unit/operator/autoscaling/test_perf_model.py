"""The engine's performance model: the fit recovers what it measures, and predicts sanely."""
from __future__ import annotations

import random

import pytest

from kaon_operator.autoscaling.perf_model import GridPoint, PerfModel, fit

TRUE = (0.02, 0.0015, 0.0004, 0.000002)  # a, b, c, d


def synthetic_grid(noise: float = 0.0, seed: int = 0) -> list[GridPoint]:
    rng = random.Random(seed)
    a, b, c, d = TRUE
    grid = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for context in (16, 384, 1024):
            tokens = batch * context
            grid.append(GridPoint(batch, 0, tokens, (a + b * batch + d * tokens) * (1 + rng.gauss(0, noise))))
    for prompt in (64, 256, 512, 1024):
        grid.append(GridPoint(0, prompt, prompt, (a + c * prompt + d * prompt) * (1 + rng.gauss(0, noise))))
    return grid


def test_the_fit_recovers_known_coefficients_from_a_synthetic_grid():
    assert fit(synthetic_grid()) == pytest.approx(TRUE, rel=1e-6)


def test_the_fit_tolerates_measurement_noise():
    for got, want in zip(fit(synthetic_grid(noise=0.02)), TRUE):
        assert got == pytest.approx(want, rel=0.15)


def test_a_term_the_grid_does_not_vary_is_zero_and_a_negative_slope_is_clamped():
    flat = [GridPoint(b, 0, 0, 0.01 + 0.002 * b) for b in (1, 2, 4, 8)]  # no prefill, no context measured
    assert fit(flat) == pytest.approx((0.01, 0.002, 0.0, 0.0), abs=1e-9)
    noisy = [GridPoint(b, 0, 0, 0.01 - 1e-6 * b) for b in (1, 2, 4, 8)]
    a, b, _, _ = fit(noisy)
    assert b == 0 and a == pytest.approx(0.01, rel=0.01)


def test_the_model_round_trips_as_json_and_refuses_nonsense():
    model = PerfModel(*TRUE, cold_start_seconds=30.0, key={"device": "cpu"}, grid=tuple(synthetic_grid()[:3]))
    assert PerfModel.from_json(model.to_json()) == model
    with pytest.raises(ValueError):
        PerfModel.from_json('{"a": 0, "b": 1, "c": 1}')
    with pytest.raises((ValueError, TypeError, KeyError)):
        PerfModel.from_json('{"a": 1, "b": "x", "c": 1}')


def test_predicted_latency_grows_with_load_and_prompt_length_and_saturates():
    model = PerfModel(*TRUE)
    light, heavy = model.predict(1.0, 256, 64), model.predict(3.5, 256, 64)
    assert light.utilization < heavy.utilization < 1
    assert light.ttft_p99 < heavy.ttft_p99 and light.step_seconds < heavy.step_seconds
    assert model.predict(1.0, 1024, 64).ttft_p99 > model.predict(1.0, 256, 64).ttft_p99
    assert model.predict(100.0, 256, 64).ttft_p99 == float("inf")
