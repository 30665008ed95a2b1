"""Clean stops of the local cluster: Ctrl-C in a terminal (SIGINT to the whole foreground process
group) and SIGTERM to the harness both stop it and every process it started within STOP_WITHIN seconds.

The harness runs as `python -c` in a process group of its own, as a shell runs a foreground job;
e2e.local_cluster starts the same processes as `python -m e2e.demo --keep` (control plane, KWOK,
operator, router, pod runner) without loading a model.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e.control_plane import build_binaries

ROOT = Path(__file__).resolve().parents[2]
HARNESS = """
import faulthandler, signal, sys, time
faulthandler.register(signal.SIGUSR1, all_threads=True)  # the test asks where it hangs before killing it
from e2e.control_plane import stop_on_sigterm
from e2e.local_cluster import LocalCluster
stop_on_sigterm()
try:
    with LocalCluster() as cluster:
        print("up", flush=True)
        while True:
            time.sleep(3600)
except KeyboardInterrupt:
    print("stopped", flush=True)
"""


def descendants(root: int) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parents.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


STOP_WITHIN = 20


def as_a_foreground_job() -> None:
    """A shell's foreground job takes Ctrl-C; a job started in the background by a non-interactive
    shell (how CI may run the suite) inherits SIGINT ignored, and Python then installs no
    KeyboardInterrupt handler: the harness would sleep through the SIGINT this test sends."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def binaries():
    return build_binaries()


@pytest.mark.parametrize("how", ["SIGINT to the process group", "SIGTERM to the harness"])
def test_the_local_cluster_stops_with_everything_it_started(binaries, how, tmp_path):
    with open(tmp_path / "harness.log", "w") as log:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-c", HARNESS], cwd=ROOT, start_new_session=True, text=True,
                                preexec_fn=as_a_foreground_job,
                                stdout=subprocess.PIPE, stderr=log)
    try:
        assert proc.stdout.readline().strip() == "up", (tmp_path / "harness.log").read_text()[-3000:]
        started = descendants(proc.pid)
        names = {Path(f"/proc/{pid}/exe").resolve().name for pid in started if alive(pid)}
        assert {"etcd", "kube-apiserver", "kwok"} <= names, names
        assert len(started) >= 7, names  # the control plane's five, the operator, the router
        if how.startswith("SIGINT"):
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        start = time.monotonic()
        try:
            proc.wait(timeout=STOP_WITHIN)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1)
            pytest.fail(f"the harness still ran {STOP_WITHIN} s after {how}; its threads:\n"
                        + (tmp_path / "harness.log").read_text()[-6000:])
        assert proc.stdout.read().strip() == "stopped"  # it unwound, no traceback
        deadline = start + STOP_WITHIN
        while time.monotonic() < deadline and any(alive(pid) for pid in started):
            time.sleep(0.2)
        left = {pid: Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")[:80]
                for pid in started if alive(pid)}
        assert not left, f"still running {time.monotonic() - start:.0f} s after {how}: {left}"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
