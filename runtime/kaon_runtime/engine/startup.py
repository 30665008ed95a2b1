"""How long this process took to start serving, by phase: what `kaon serve` logs once it is ready and exposes
as `kaon_startup_seconds{phase}` (issue 53 §2).

  import         from the process's start to the engine's construction, less the fetch: Python, torch,
                 kaon and the server's packages
  fetch          downloading an hf:// or s3:// model into the model cache (0 when it is local or cached)
  load           opening the checkpoint and putting its weights in their kernel layouts
  kv_allocation  sizing and zeroing the KV pool
  warmup         CUDA graph capture on a GPU; then whatever remains until the server listens (the
                 scheduler, grammars, the app and uvicorn's start-up)

One record per process (an engine's start-up is its process's); a new engine's construction starts its
own load, kv_allocation and warmup afresh.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from pathlib import Path

PHASES = ("import", "fetch", "load", "kv_allocation", "warmup")
_ENGINE_PHASES = ("load", "kv_allocation", "warmup")
_seconds: dict[str, float] = {}


def record(phase: str, seconds: float) -> None:
    """Add `seconds` to `phase` (a phase may come in pieces)."""
    if phase not in PHASES:
        raise ValueError(f"unknown start-up phase {phase!r}; phases: {', '.join(PHASES)}")
    _seconds[phase] = _seconds.get(phase, 0.0) + max(seconds, 0.0)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    start = time.perf_counter()
    try:
        yield
    finally:
        record(name, time.perf_counter() - start)


def engine_starting() -> None:
    """A new engine is being built: its phases start from nothing; import is what the process took so far."""
    for name in _ENGINE_PHASES:
        _seconds.pop(name, None)
    _seconds.setdefault("fetch", 0.0)  # a local or cached model: nothing fetched, and /metrics says so
    if "import" not in _seconds:
        record("import", process_age() - _seconds.get("fetch", 0.0))


def serving() -> str:
    """The server listens: the rest of the start-up is warmup's; returns the breakdown as one log line."""
    record("warmup", process_age() - sum(_seconds.values()))
    parts = ", ".join(f"{name} {_seconds.get(name, 0.0):.2f} s" for name in PHASES)
    return f"start-up {sum(_seconds.values()):.2f} s to ready: {parts}"


def seconds() -> dict[str, float]:
    return dict(_seconds)


def reset() -> None:
    _seconds.clear()


def process_age() -> float:
    """Seconds since this process started (Linux's /proc; elsewhere since this module was imported)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19]) / ticks
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return max(uptime - started, 0.0)
    except (OSError, ValueError, IndexError):
        return time.monotonic() - _IMPORTED


_IMPORTED = time.monotonic()
