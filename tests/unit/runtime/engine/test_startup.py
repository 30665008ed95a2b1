"""The start-up breakdown (issue 53 §2): each phase's seconds recorded once per engine, logged by `kaon serve`
once it is ready and exposed as kaon_startup_seconds{phase} on /metrics."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from kaon_runtime.engine import startup
from support.server import Server

TICK = 0.02  # /proc/uptime's resolution, twice: the process's age is read from it


@pytest.fixture(autouse=True)
def fresh_record():
    saved = startup.seconds()
    startup.reset()
    yield
    startup.reset()
    for name, value in saved.items():
        startup.record(name, value)


def test_phases_add_up_and_a_new_engine_starts_its_own():
    startup.record("fetch", 2.0)
    # Bounded by the process's age just before and just after (to /proc's 10 ms ticks), not by a tolerance
    # that a busy machine's pause between two lines can pass.
    before = startup.process_age()
    startup.engine_starting()
    after = startup.process_age()
    assert max(before - 2.0, 0.0) - TICK <= startup.seconds()["import"] <= max(after - 2.0, 0.0) + TICK
    with startup.phase("load"):
        time.sleep(0.05)
    startup.record("load", 1.0)  # a phase may come in pieces (the checkpoint's header, then its weights)
    assert startup.seconds()["load"] >= 1.05
    startup.record("kv_allocation", 0.5)
    startup.engine_starting()  # the next engine of this process: its load and KV pool are its own
    assert "load" not in startup.seconds() and "kv_allocation" not in startup.seconds()
    assert startup.seconds()["fetch"] == 2.0


def test_serving_gives_the_rest_to_warmup_and_one_line_with_every_phase():
    startup.engine_starting()
    startup.record("load", 0.25)
    before = startup.process_age()
    line = startup.serving()
    after = startup.process_age()
    total = sum(startup.seconds().values())
    # Every second of the start is in a phase; a recorded phase longer than the time since the last one can
    # pass the process's age (warmup is never negative).
    assert before - TICK <= total <= max(after, startup.seconds()["import"] + 0.25) + TICK
    assert line.startswith(f"start-up {total:.2f} s to ready: import ")
    assert all(f"{name} " in line for name in startup.PHASES)


def test_an_unknown_phase_is_refused():
    with pytest.raises(ValueError, match="unknown start-up phase"):
        startup.record("coffee", 1.0)


@pytest.mark.slow
def test_kaon_serve_logs_its_start_up_and_exposes_it_on_metrics(tmp_path):
    began = time.monotonic()
    server = Server(tmp_path, "--log-level", "info")
    try:
        waited = time.monotonic() - began
        text = httpx.get(f"{server.url}/metrics").text
        found = {m.group(1): float(m.group(2))
                 for m in re.finditer(r'^kaon_startup_seconds\{phase="(\w+)"\} (\S+)$', text, re.M)}
        assert set(found) == set(startup.PHASES)
        assert found["load"] > 0 and found["import"] > 0 and found["fetch"] == 0  # a local model: nothing fetched
        assert sum(found.values()) <= waited + 1  # the phases are the time to ready, no more
        assert re.search(r"start-up [\d.]+ s to ready: import [\d.]+ s, fetch 0\.00 s, load [\d.]+ s",
                         server.log.read_text())
    finally:
        server.stop()
