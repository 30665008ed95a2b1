"""The routers' fast signal for services with standby replicas (issue 53): what Knative's activator does.

The autoscale loop sees a burst only at its next scrape (every 5 s), and the predictive policy then needs
some seconds of arrivals to prove it (3 Poisson deviations over its short windows): 12-18 s in the
simulator, while the burst's first requests miss their TTFT. The router knows sooner: it holds the
requests of a service with no ready replica, and it counts the requests in flight to each ready one. The
pressure loop (pressure_sync.py) reads every router's `GET /pressure` (admin port) each second, and this
pure decision turns what they report into a wake of standbys, at once, when capacity is short:

- **from zero**: requests held and no replica wanted yet: every standby is woken (as standby.from_zero);
- **a queue**: requests in flight plus held at least SHORT_FACTOR x the concurrency target of the ready
  replicas (Knative's panic threshold is 200% of it; 1.5 here: a wake costs seconds and is undone by the
  regular policy's scale-down after its stabilization window): every loaded standby is woken (within
  maxStep and maxReplicas). Not just what the concurrency asks for at the target: by the time the engines
  queue 1.5x their target a burst has been arriving for seconds, and the queue grows until the woken
  replicas serve; in the simulator sizing by the concurrency missed more of a burst's first seconds
  (bursts, seed 0: 98.54% against 98.97% of requests within the TTFT target). Never a cold start: that
  stays the regular policy's to prove.

It only ever adds replicas; the regular policy, on its own scrapes, decides everything else, so a report
that is lost (a router that does not answer) changes nothing but when the wake comes.
"""
from __future__ import annotations

from dataclasses import dataclass

from kaon_operator.api import AutoscalingSpec
from kaon_operator.autoscaling import autoscaler

SHORT_FACTOR = 1.5
"""Concurrency (in flight + held) per ready replica, as a multiple of the target, at which capacity is short.
Knative's panic mode enters at 2x; lower, because the wake it buys is cheap and the TTFT target is missed by
the time the engines queue 2x their target (in the simulator's calibrated engine)."""


@dataclass(frozen=True, slots=True)
class Pressure:
    """What the routers report for one service, summed over the routers."""

    held: float
    """Requests held because the service has no ready replica."""
    in_flight: float
    """Requests forwarded to its ready replicas and not answered yet (running or queued in the engines)."""
    ready: int
    """Ready replicas the routers send to (the most any router sees)."""


def short(pressure: Pressure, spec: AutoscalingSpec, max_num_seqs: int) -> bool:
    """Capacity is short: requests held with nothing ready, or a concurrency past SHORT_FACTOR x the target."""
    if pressure.ready == 0:
        return pressure.held > 0
    target = autoscaler.concurrency_target(spec, max_num_seqs)
    return pressure.in_flight + pressure.held >= SHORT_FACTOR * target * pressure.ready


def decide(pressure: Pressure, spec: AutoscalingSpec, current: int, asleep: int, max_num_seqs: int
           ) -> autoscaler.Decision | None:
    """The replicas to scale to at once (waking standbys), or None to leave it to the regular policy.

    `current`: spec.replicas; `asleep`: standbys loaded and asleep now (what a wake can bring)."""
    if not spec.enabled or not spec.standby or asleep <= 0 or not short(pressure, spec, max_num_seqs):
        return None
    if pressure.ready == 0:
        if current > 0:
            return None  # replicas are starting or waking already: the held requests wait for them
        wanted = min(spec.standby, asleep, spec.max_replicas)
        return autoscaler.Decision(wanted, f"the router holds {pressure.held:g} requests with no ready replica: "
                                           f"{wanted} standby(s) woken at once")
    target = autoscaler.concurrency_target(spec, max_num_seqs)
    demand = pressure.in_flight + pressure.held
    wanted = min(current + asleep, current + spec.max_step, spec.max_replicas)
    if wanted <= current:
        return None
    return autoscaler.Decision(wanted, f"the routers see {demand:g} requests in flight or held for {pressure.ready} "
                                       f"ready replica(s) (short at {SHORT_FACTOR:g}x the target of {target:g} each): "
                                       f"{wanted - current} standby(s) woken at once")
