"""A real Valkey (or Redis) server for the shared response cache's tests: Debian's package, installed
by e2e/install-valkey.sh when missing, started here on a free port with no persistence."""
from __future__ import annotations

import contextlib
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from e2e.control_plane import free_port

INSTALL = Path(__file__).resolve().parents[2] / "e2e" / "install-valkey.sh"


@contextlib.contextmanager
def valkey_server():
    """Yields redis://127.0.0.1:<port>/0 of a server of its own."""
    found = subprocess.run(["bash", str(INSTALL)], capture_output=True, text=True, timeout=600)
    if found.returncode != 0:
        pytest.fail(f"e2e/install-valkey.sh failed: {found.stderr[-2000:]}")
    binary = found.stdout.strip().splitlines()[-1]
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        process = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                    "--appendonly", "no", "--dir", tmp], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 30  # starts in a moment; room for a busy machine
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline or process.poll() is not None:
                        pytest.fail(f"{binary} did not start on port {port}")
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            process.terminate()
            process.wait(10)
