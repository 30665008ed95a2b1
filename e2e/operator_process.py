"""The kaon operator as a child process, for tests, benchmarks and the e2e harness.

It runs `python -m kaon_operator` against a kubeconfig (in tests: the least-privilege
ServiceAccount from deploy/operator-rbac.yaml), logs to a file, and is ready once kopf's
liveness endpoint answers. kill() is a SIGKILL, to test recovery from a crash.
"""
from __future__ import annotations

import os
import subprocess
import sys
import urllib.request
from pathlib import Path

from e2e.control_plane import _die_with_parent, free_port, terminate, wait_until_answering


class OperatorProcess:
    def __init__(self, kubeconfig: Path, log_path: Path, *extra_args: str):
        self.kubeconfig = kubeconfig
        self.log_path = log_path
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None
        self.metrics_port = 0

    def start(self, timeout: float = 60) -> OperatorProcess:
        liveness, self.metrics_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig)}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kaon_operator", "--liveness-port", str(liveness),
                 "--metrics-port", str(self.metrics_port), *self.extra_args],
                env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
        try:
            wait_until_answering(self.proc, f"http://127.0.0.1:{liveness}/healthz", timeout, "the operator", "")
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}\n{self.log()}") from None
        return self

    def stop(self) -> None:
        if self.proc:
            terminate(self.proc, grace=20)

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            return resp.read().decode()

    def rss_bytes(self) -> int:
        if self.proc is None:
            return 0
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        return 0

    def log(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])
