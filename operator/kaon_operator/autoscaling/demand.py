"""The load an autoscaler reads from scrapes, and the latency the performance model predicts for it.

Pure functions, shared by the predictive policy (predictive.py) and the bias it learns
(model_bias.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling.autoscaler import Sample
from kaon_operator.autoscaling.perf_model import OUTPUT_TAIL, PerfModel, Prediction


@dataclass(frozen=True, slots=True)
class Load:
    rate: float
    """Requests arriving per second."""
    prompt: float
    output: float
    """Mean prompt and output tokens per request."""
    requests: float
    """Requests the estimate rests on."""
    seconds: float = 0.0

    def bound(self, sigmas: float) -> Load:
        """The load with its rate moved `sigmas` Poisson standard deviations (negative: down)."""
        spread = sigmas * math.sqrt(max(self.requests, 1.0)) / self.seconds if self.seconds else 0.0
        return Load(max(0.0, self.rate + spread), self.prompt, self.output, self.requests, self.seconds)


def mean_output(samples: list[Sample], arrived: float) -> float:
    """Output tokens per request: the lengths of the requests that finished over their count
    where the engines report them; else tokens generated over arrivals (in a steady state
    tokens are generated at the arrival rate x the mean output, but while a load rises they
    lag: a burst's requests read 25 tokens long against a true 72)."""
    finished = sum(s.finished for s in samples)
    if finished and all(s.finished_output_tokens is not None for s in samples):
        return sum(s.finished_output_tokens or 0.0 for s in samples) / finished
    return sum(s.output_tokens for s in samples) / arrived if arrived else 0.0


def load(samples: list[Sample]) -> Load | None:
    """The load over consecutive samples: arrivals = finished + the change in concurrency;
    mean prompt = prompt tokens over arrivals (counted as requests are accepted), mean output
    as `mean_output`. None with fewer than two samples."""
    if len(samples) < 2:
        return None
    span = samples[-1].time - samples[0].time
    seconds = span * len(samples) / (len(samples) - 1)  # the first sample's own interval too
    finished = sum(s.finished for s in samples)
    arrived = max(0.0, finished + samples[-1].estimated_concurrency - samples[0].estimated_concurrency)
    prompt = sum(s.prompt_tokens for s in samples) / arrived if arrived else 0.0
    return Load(arrived / seconds if seconds > 0 else 0.0, prompt, max(1.0, mean_output(samples, arrived)),
                arrived, seconds)


def latency(model: PerfModel, spec: AutoscalingSpec, prediction: Prediction, output: float) -> float:
    """The predicted P99 of the spec's latency metric."""
    if spec.latency_metric == "e2e":
        return prediction.ttft_p99 + OUTPUT_TAIL * output * prediction.itl
    if spec.latency_metric == "itl":  # a decode pool's (spec.prefill): one step, its tail not modelled
        return prediction.itl
    return prediction.ttft_p99
