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


def _answering(reply: bytes):
    """A one-connection TCP server on 127.0.0.1 that sends `reply` to the first request and closes: (port, thread)."""
    import socket
    import threading

    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with server:
            conn, _ = server.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return server.getsockname()[1], thread


def test_an_engine_cut_off_mid_answer_is_a_failed_probe_not_an_exception():
    """Killed while answering, an engine leaves a bad status line or a short body: HTTPExceptions, which are no
    OSErrors. Raised, the probe would stay in flight with its exception, and the pod runner would never probe
    that pod again (every later look at it raising first)."""
    from e2e.probes import http_probe

    for reply in (b"garbage that is no status line\r\n\r\n",
                  b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 100\r\n\r\nshort"):
        port, thread = _answering(reply)
        ok, why = http_probe({"httpGet": {"path": "/health", "port": port}, "timeoutSeconds": 5}, "127.0.0.1", {})
        thread.join(5)
        assert ok is False and why, reply
