"""A real `kaon serve` process on a free port, for the server's tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

MODEL = "builtin://smollm2-135m-instruct"
API_KEY = "test-key"
RUNTIME = Path(__file__).resolve().parents[2] / "runtime"


class Server:
    def __init__(self, tmp: Path, *extra: str, env: dict[str, str] | None = None,
                 launcher: tuple[str, ...] = ("-m", "kaon_runtime.cli"), ready_timeout_s: float = 120):
        """`launcher`: what python runs with the CLI's arguments (small_send_buffer_launcher below);
        `ready_timeout_s`: how long it may take to answer /ready (two engines loading at once take longer)."""
        # The free port is only reserved until the server binds it, after loading the model; on
        # a busy machine something else can take it in between, so try another one then.
        for attempt in range(3):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self.log = tmp / f"serve-{self.port}.log"
            environment = {**os.environ, **(env or {}),
                           "PYTHONPATH": f"{RUNTIME}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            environment.pop("KAON_API_KEY", None)
            with open(self.log, "wb") as log:
                self.proc = subprocess.Popen(
                    [sys.executable, *launcher, "serve", "--model", MODEL, "--port", str(self.port),
                     "--device", "cpu", "--dtype", "float32", "--log-level", "warning", *extra],
                    stdout=log, stderr=subprocess.STDOUT, env=environment)
            if self._wait_ready(last_attempt=attempt == 2, timeout_s=ready_timeout_s):
                return

    def _wait_ready(self, last_attempt: bool, timeout_s: float = 120) -> bool:
        """True once ready; False if the port was taken meanwhile (and another attempt is left)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log.read_text()
                if "address already in use" in log and not last_attempt:
                    return False
                raise AssertionError(f"kaon serve exited early:\n{log}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=1).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"kaon serve not ready after {timeout_s}s:\n{self.log.read_text()}")

    def metric(self, name: str) -> float:
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
        raise KeyError(name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def small_send_buffer_launcher(send_buffer_bytes: int) -> tuple[str, ...]:
    """`kaon serve` whose listening socket has a fixed SO_SNDBUF, which Linux gives each accepted
    connection (and so turns off its autotuning, which grows a loopback send buffer to 4 MB): a
    client that stops reading stalls the server's writes after kilobytes instead of megabytes.
    Only the kernel's buffer changes; the server's code is the one users run."""
    # uvicorn picks uvloop when it is installed (a dependency since the router moved to it), whose
    # create_server is not asyncio's: the listening socket is made here, for either loop, and handed to
    # uvicorn as a process manager would hand it one.
    code = f"""
import runpy, socket, uvicorn
startup = uvicorn.Server.startup
async def with_small_send_buffer(self, sockets=None):
    if sockets is None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, {send_buffer_bytes})
        sock.bind((self.config.host, self.config.port))
        sockets = [sock]
    await startup(self, sockets)
uvicorn.Server.startup = with_small_send_buffer
runpy.run_module("kaon_runtime.cli", run_name="__main__", alter_sys=True)
"""
    return ("-c", code)


def error_body(response: httpx.Response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.fixture(scope="session")
def default_server(tmp_path_factory):
    """One `kaon serve` of the bundled model with the default flags, shared by the modules that need no
    other (an engine start is ~9 CPU s; tests/conftest.py registers it): none of them changes its state
    beyond what a request does."""
    srv = Server(tmp_path_factory.mktemp("serve-default"))
    yield srv
    srv.stop()
