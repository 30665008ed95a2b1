"""Cold start against a wake (issue 53): time to /ready of a new `kaon serve` of the bundled model, and
time to /ready after a wake from sleep level 1 and level 2 of the same server; its RSS awake and asleep.

    python bench/sleep_wake.py [--rounds 3] [--kv-cache-bytes N] [--json]

The comparison is the cold start (exec to /ready: imports, load, KV allocation); the ratio printed is
wake / cold, the issue's goal <= 0.10 and a wake <= 3 s. Each wake is timed from POST /wake_up to
/ready answering 200, as the operator and the router see it; the answer after each wake is checked
equal to the answer before the first sleep (greedy).

The first answer after each wake is timed against an answer when awake (same prompt, 8 tokens): a
level-2 wake maps the weights back and pays their page faults on first use, a level-1 wake reallocates
the KV pool, so the first request after a wake can be slower than one on a replica that never slept.
`first_answer_extra_s` is that difference (median over the rounds), the part of a wake that /ready
does not show; the autoscaling simulator's wake adds it (bench/autoscale_sim.py --wake-s).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin://smollm2-135m-instruct"
ADMIN = "bench-admin-key"


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) / 1024


def wait_ready(url: str, proc: subprocess.Popen | None = None, timeout: float = 300.0) -> float:
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        if proc is not None and proc.poll() is not None:
            raise SystemExit("kaon serve exited early")
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        time.sleep(0.02)
    raise SystemExit(f"not ready after {timeout} s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="sleep/wake rounds per level")
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30, help="the pool (kaon serve's default 1 GiB)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--port", str(port),
                             "--device", "cpu", "--dtype", "float32", "--enable-sleep-mode", "--admin-key", ADMIN,
                             "--kv-cache-bytes", str(args.kv_cache_bytes), "--log-level", "warning"],
                            stdout=subprocess.DEVNULL, env=env)  # warnings and errors to our stderr
    try:
        wait_ready(url, proc)
        cold = time.perf_counter() - started
        admin = {"Authorization": f"Bearer {ADMIN}"}
        http = httpx.Client(base_url=url, timeout=300)

        def answer() -> str:
            reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "The capital of France is",
                                                       "max_tokens": 8, "temperature": 0})
            reply.raise_for_status()
            return reply.json()["choices"][0]["text"]

        def timed_answer() -> tuple[str, float]:
            t = time.perf_counter()
            text = answer()
            return text, time.perf_counter() - t

        before = answer()
        awake = [timed_answer()[1] for _ in range(max(3, args.rounds))]  # the steady answer, never slept
        figures: dict = {"cold_start_to_ready_s": round(cold, 2), "rss_awake_mib": round(rss_mib(proc.pid)),
                         "awake_answer_s": round(statistics.median(awake), 3)}
        for level in (1, 2):
            sleeps, wakes, asleep_rss, firsts, seconds = [], [], [], [], []
            for _ in range(args.rounds):
                t = time.perf_counter()
                http.post("/sleep", params={"level": level}, headers=admin).raise_for_status()
                sleeps.append(time.perf_counter() - t)
                asleep_rss.append(rss_mib(proc.pid))
                t = time.perf_counter()
                http.post("/wake_up", headers=admin).raise_for_status()
                wait_ready(url)
                wakes.append(time.perf_counter() - t)
                text, first = timed_answer()
                if text != before:
                    raise SystemExit(f"the answer changed after a wake from level {level}")
                firsts.append(first)
                seconds.append(timed_answer()[1])
            figures[f"level{level}"] = {"sleep_s": round(statistics.median(sleeps), 2),
                                        "wake_to_ready_s": round(statistics.median(wakes), 2),
                                        "wake_max_s": round(max(wakes), 2),
                                        "rss_asleep_mib": round(statistics.median(asleep_rss)),
                                        "wake_vs_cold": round(statistics.median(wakes) / cold, 3),
                                        "first_answer_s": round(statistics.median(firsts), 3),
                                        "first_answer_max_s": round(max(firsts), 3),
                                        "second_answer_s": round(statistics.median(seconds), 3),
                                        "first_answer_extra_s": round(statistics.median(firsts)
                                                                      - statistics.median(awake), 3)}
    finally:
        proc.kill()
        proc.wait()
    figures["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}"
    figures["rounds"] = args.rounds
    figures["kv_cache_bytes"] = args.kv_cache_bytes
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"kaon serve {MODEL} (CPU, float32, KV pool {args.kv_cache_bytes >> 20} MiB); {figures['machine']}")
    print(f"cold start (exec to /ready): {figures['cold_start_to_ready_s']:.2f} s; RSS awake "
          f"{figures['rss_awake_mib']} MiB; an answer when awake (8 tokens) {figures['awake_answer_s']:.3f} s")
    for level in (1, 2):
        f = figures[f"level{level}"]
        print(f"level {level}: sleep {f['sleep_s']:.2f} s, RSS asleep {f['rss_asleep_mib']} MiB; wake to /ready "
              f"{f['wake_to_ready_s']:.2f} s (max {f['wake_max_s']:.2f}) = {f['wake_vs_cold']:.3f} x the cold start; "
              f"first answer after it {f['first_answer_s']:.3f} s (max {f['first_answer_max_s']:.3f}; the second "
              f"{f['second_answer_s']:.3f} s) = {f['first_answer_extra_s']:+.3f} s against awake")
    return 0


if __name__ == "__main__":
    sys.exit(main())
