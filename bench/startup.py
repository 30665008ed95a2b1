"""Time from exec to /ready of `kaon serve` on the bundled model, and its start-up breakdown (issue 53 §2).

    python bench/startup.py [--runs 3] [--baseline PATH] [--model builtin://smollm2-135m-instruct]

Each run starts `python -m kaon_runtime.cli serve` (CPU, --kv-cache-bytes 256 MiB) in a fresh process,
polls /ready every 20 ms from the moment of exec, and on 200 reads `kaon_startup_seconds{phase}` from
/metrics (import, fetch, load, kv_allocation, warmup: engine/startup.py) and the process's peak resident
memory (/proc/<pid>/status VmHWM), then stops it. --baseline PATH runs the same from another checkout's
runtime/ (e.g. a worktree of the commit before a change) in the same session, alternating with this one,
and prints the ratio of the medians; a baseline without the metric shows its time to ready alone.
"""
from __future__ import annotations

import argparse
import os
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("import", "fetch", "load", "kv_allocation", "warmup")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(runtime: Path, model: str) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(runtime)}
    command = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", model, "--device", "cpu",
               "--port", str(port), "--kv-cache-bytes", str(256 << 20), "--log-level", "warning"]
    start = time.perf_counter()
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(f"kaon serve exited: {process.stderr.read()[-2000:] if process.stderr else ''}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            time.sleep(0.02)
        ready = time.perf_counter() - start
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
        phases = {m.group(1): float(m.group(2))
                  for m in re.finditer(r'^kaon_startup_seconds\{phase="(\w+)"\} (\S+)$', text, re.M)}
        status = Path(f"/proc/{process.pid}/status").read_text()
        peak = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1)) << 10
        return dict(ready=ready, phases=phases, peak=peak)
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()


def summary(name: str, runs: list[dict]) -> float:
    ready = statistics.median(r["ready"] for r in runs)
    peak = statistics.median(r["peak"] for r in runs) / 2 ** 20
    each = ", ".join(f"{r['ready']:.2f}" for r in runs)
    line = f"{name:<9} ready {ready:6.2f} s (runs: {each}), peak RSS {peak:.0f} MiB"
    if all(r["phases"] for r in runs):
        line += "; " + ", ".join(f"{p} {statistics.median(r['phases'].get(p, 0.0) for r in runs):.2f}" for p in PHASES)
    print(line, flush=True)
    return ready


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--baseline", type=Path, help="another checkout's root, run alternately as the baseline")
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; {args.model}; median of {args.runs} runs; "
          "phases in seconds (kaon_startup_seconds)")
    ours, base = [], []
    for _ in range(args.runs):
        if args.baseline:
            base.append(one_start(args.baseline / "runtime", args.model))
        ours.append(one_start(ROOT / "runtime", args.model))
    now = summary("this tree", ours)
    if args.baseline:
        before = summary("baseline", base)
        print(f"time to ready, this tree / baseline: {now / before:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
