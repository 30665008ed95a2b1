"""The pod runner's quick looks between a probe's declared runs (e2e/probes.py): a success is seen
sooner, and nothing else changes: failures, thresholds and the startup budget are the declared ones."""
from __future__ import annotations

from e2e.probes import ProbeState

STARTUP = {"periodSeconds": 10, "failureThreshold": 3}


def run(probe: ProbeState, ok: bool, now: float) -> bool | None:
    """One GET started and answered at `now`, as the pod runner does when the probe is due."""
    assert probe.due(now), now
    probe.begin(object(), now)  # type: ignore[arg-type]  # only its presence matters here
    return probe.record(ok, now)


def test_a_look_sees_the_engine_start_before_the_next_declared_run():
    probe = ProbeState("startupProbe", STARTUP, started_at=0.0, look=1.0)
    assert run(probe, False, 0.0) is None  # the declared first run: loading
    assert not probe.due(0.5) and probe.due(1.0)
    for t in (1.0, 2.0, 3.0):
        assert run(probe, False, t) is None
    assert run(probe, True, 4.0) is True  # seen at 4 s, not at the 10 s run
    assert not probe.due(5.0) and probe.due(14.0)  # succeeded: declared runs only


def test_failed_looks_count_nothing_so_the_startup_budget_is_the_declared_one():
    looked = ProbeState("startupProbe", STARTUP, started_at=0.0, look=1.0)
    plain = ProbeState("startupProbe", STARTUP, started_at=0.0)
    verdicts = {}
    for t in range(31):
        for name, probe in (("looked", looked), ("plain", plain)):
            if probe.due(float(t)) and probe.result is None and run(probe, False, float(t)) is False:
                verdicts[name] = t
    assert verdicts == {"looked": 20, "plain": 20}  # three declared failures: 0, 10, 20 s


def test_without_looks_a_probe_runs_only_as_declared():
    probe = ProbeState("startupProbe", STARTUP, started_at=0.0)
    assert run(probe, False, 0.0) is None
    assert not any(probe.due(t) for t in (1.0, 5.0, 9.9)) and probe.due(10.0)
