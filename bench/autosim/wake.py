"""A standby's wake, part by part: the profiled one (the default) or a constant."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from kaon_operator.autoscaling import standby


@dataclass
class Wake:
    """From a standby's wake ordered to it taking requests, part by part (issue 53: "wake times from the profile").

    A constant `--wake-s X` is `Wake(engine_s=X)` (what every standby run before the profiled wake used). The
    profiled wake (`PROFILED`, the default) holds, each part measured or stated in bench/history/sleep_wake.md:
    - engine_s: POST /wake_up to /ready at the level standbys sleep at (standby.SLEEP_LEVEL, level 1), plus the
      first answer's extra time after a wake against one when awake (bench/sleep_wake.py);
    - probe_period_s: the kubelet reads /ready every STANDBY_READINESS_PERIOD_SECONDS on its own phase, so the
      pod turns Ready uniformly 0..period after the engine does (drawn, not its mean);
    - ready_to_router_s: the pod's Ready condition written by the kubelet and seen by the routers' pod watch
      (router/watch.py: the routers watch pods, not Endpoints);
    - round_s: a wake the regular policy orders (spec.replicas written) waits for the standby loop's next round
      (standby_sync.INTERVAL_SECONDS), uniformly 0..round; the pressure loop wakes in the same breath (its own
      latency is Poke.latency_s), so a poked wake skips it.
    """
    engine_s: float = 0.0
    probe_period_s: float = 0.0
    ready_to_router_s: float = 0.0
    round_s: float = 0.0
    rng: random.Random = field(default_factory=lambda: random.Random(0), compare=False, repr=False)

    def round_delay(self, poked: bool) -> float:
        """The wait for the standby loop's round: one draw per scale-up (one round wakes every standby it needs)."""
        return self.rng.uniform(0.0, self.round_s) if self.round_s and not poked else 0.0

    def seconds(self, round_delay: float = 0.0) -> float:
        """One pod's wake after its round: the fixed parts and its own probe phase (no draw when the period is 0,
        so a constant wake draws nothing)."""
        probe = self.rng.uniform(0.0, self.probe_period_s) if self.probe_period_s else 0.0
        return round_delay + self.engine_s + probe + self.ready_to_router_s

    def mean(self, poked: bool = False) -> float:
        return self.engine_s + self.ready_to_router_s + self.probe_period_s / 2 + (0.0 if poked else self.round_s / 2)

    def describe(self) -> str:
        if not (self.probe_period_s or self.ready_to_router_s or self.round_s):
            return f"a wake takes {self.engine_s:g} s"
        return (f"a wake takes {self.engine_s:g} s (engine) + {self.ready_to_router_s:g} s (Ready to the routers) + "
                f"U(0, {self.probe_period_s:g}) s (readiness probe) + U(0, {self.round_s:g}) s (standby loop's round, "
                f"regular scale-ups only): mean {self.mean():.2f} s, {self.mean(poked=True):.2f} s on a poke")


ENGINE_WAKE_S = 0.21
"""kaon serve of the bundled model (CPU), POST /wake_up to /ready from level 1, median of 10 (max 0.23 s), plus the
first answer's extra after it (+0.001 s): bench/sleep_wake.py, 2026-11-30 17:22 UTC, load 0.5-1.2
(bench/history/sleep_wake.md)."""
READY_TO_ROUTER_S = 0.1
"""The kubelet's status write and the routers' watch event: an estimate (the apiserver's part measured 8 ms median,
47 ms max on the local control plane, bench/pod_ready_watch.py; the kubelet's part not), history/sleep_wake.md."""
PROFILED = Wake(ENGINE_WAKE_S, probe_period_s=standby.STANDBY_READINESS_PERIOD_SECONDS,
                ready_to_router_s=READY_TO_ROUTER_S, round_s=2.0)
"""The profiled wake (the default): round_s is standby_sync.INTERVAL_SECONDS (the simulator does not import the
operator's I/O modules; tests/unit/bench/test_autoscale_sim.py checks the two agree)."""
