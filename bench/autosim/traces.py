"""The traces: request rates over time (and length mixes), and their Poisson arrivals."""
from __future__ import annotations

import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from .engine import Workload


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
