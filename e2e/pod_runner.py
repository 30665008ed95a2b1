"""Plays the container runtime for engine pods on the local control plane.

KWOK runs pods without processes. For pods whose image is under `local/` (the stage
`kaon-pod-run-local` leaves them Running but not Ready), this starts the pod's own command
line (`kaon serve ...`, as the operator rendered it) as a real process listening on the
pod's IP, marks the pod Ready when the process' `/ready` answers 200 (what the kubelet's
readiness probe would do), and sends it SIGTERM when the pod is deleted, so the drain runs
as it would in a cluster. The whole data path is then real: router -> pod IP -> engine.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from e2e.control_plane import ControlPlane, _die_with_parent, wait_or_kill

LOCAL_IMAGE_PREFIX = "local/"


@dataclass(slots=True)
class _Process:
    proc: subprocess.Popen
    ip: str
    port: int
    ready: bool = False


def _port(args: list[str]) -> int:
    return int(args[args.index("--port") + 1]) if "--port" in args else 8000


def _command(args: list[str], ip: str) -> list[str]:
    """The pod's `kaon ...` arguments, run with this Python and bound to the pod's IP."""
    args = list(args)
    if "--host" in args:
        args[args.index("--host") + 1] = ip
    else:
        args += ["--host", ip]
    return [sys.executable, "-m", "kaon_runtime.cli", *args[1:]]


class PodRunner:
    def __init__(self, cp: ControlPlane, log_dir: Path, *, poll: float = 0.5):
        self.cp, self.log_dir, self.poll = cp, log_dir, poll
        self.processes: dict[str, _Process] = {}  # "namespace/name" -> its engine
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> PodRunner:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for key in self.processes:
            self._terminate(key)
        for engine in self.processes.values():  # all asked first, so they drain side by side
            wait_or_kill(engine.proc, grace=30)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll):
            try:
                self._sync()
            except Exception as exc:  # keep playing the runtime; the test's own checks fail loudly
                print(f"pod runner: {exc}", file=sys.stderr)

    def _sync(self) -> None:
        items = self.cp.kubectl_json("get", "pods", "-A", "-l", "app.kubernetes.io/component=engine")["items"]
        pods = {f"{p['metadata']['namespace']}/{p['metadata']['name']}": p for p in items
                if p["spec"]["containers"][0].get("image", "").startswith(LOCAL_IMAGE_PREFIX)}
        for key, pod in pods.items():
            ip = (pod.get("status") or {}).get("podIP")
            if pod["metadata"].get("deletionTimestamp"):
                self._terminate(key)
            elif ip and key not in self.processes:
                self._start(key, pod["spec"]["containers"][0]["args"], ip)
            elif key in self.processes:
                self._update_readiness(pod, key)
        for key in list(self.processes):
            going = key not in pods or pods[key]["metadata"].get("deletionTimestamp")
            if going:
                self._terminate(key)
                if self.processes[key].proc.poll() is not None:
                    del self.processes[key]

    def _start(self, key: str, args: list[str], ip: str) -> None:
        log = open(self.log_dir / f"engine-{key.replace('/', '-')}.log", "ab")
        proc = subprocess.Popen(_command(args, ip), stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, preexec_fn=_die_with_parent)
        log.close()
        self.processes[key] = _Process(proc, ip, _port(args))

    def _update_readiness(self, pod: dict, key: str) -> None:
        engine = self.processes[key]
        ready = engine.proc.poll() is None and self._probe(engine)
        if ready != engine.ready:
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status = "True" if ready else "False"
            conditions = [{"type": t, "status": status, "lastTransitionTime": now} for t in ("ContainersReady", "Ready")]
            namespace, name = key.split("/")
            self.cp.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status", "--type=strategic",
                            "-p", json.dumps({"status": {"conditions": conditions}}))
            engine.ready = ready

    @staticmethod
    def _probe(engine: _Process) -> bool:
        try:
            with urllib.request.urlopen(f"http://{engine.ip}:{engine.port}/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False

    def _terminate(self, key: str) -> None:
        engine = self.processes.get(key)
        if engine and engine.proc.poll() is None:
            engine.proc.send_signal(signal.SIGTERM)  # the engine drains, as under a kubelet
