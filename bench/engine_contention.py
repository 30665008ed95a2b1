"""An engine's decode speed on a busy machine: the step's threads spinning vs yielding while they wait, and
with or without a 1 ms timer on the event loop (the old "timer effect"), A/B in alternating windows of one run.

    python bench/engine_contention.py [--window 5] [--rounds 3] [--streams 4] [--threads 2]

One AsyncEngine (the bundled model, in this process) serves --streams clients that each stream 48-token
completions back to back. Every --window seconds the run switches arm, round-robin, so the machine's load
(other processes: run it beside them, or start some) falls on every arm alike:
- pool spin / yield: kaon_pool_set_yield (kernels/cpu_decode.c): whether a thread of the fused decode step
  that waits for another one (a chunk it claimed, the next job) yields its core past a short spin (the
  default) or spins on (before 2026-11-29);
- timer off / on: a task on the event loop that sleeps 1 ms at a time (what NIXL's UCX progress loop did,
  and the TCP transport's work-around did, while a transfer was open).
With --http: the same A/B through real `kaon serve` processes (HTTP, SSE, the client in this process): two
engines pinned alike (--cpus, --threads), one of them with the 1 ms timer on its event loop (patched in by this
script, nothing in kaon has it), the load switching between them every window. The pool's wait is the
default (yield) in both.

Printed per window: tokens/s, inter-token latency p50 as the streams see it, the engine step's p50, the pool's
yields and the 1-minute load; then each arm's median over rounds and the ratios against spin without timer.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from sse import text_arrivals  # bench/sse.py: this script's folder is on sys.path

from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.sampling import SamplingParams

MODEL = "builtin://smollm2-135m-instruct"
ROOT = Path(__file__).resolve().parents[1]
ARMS = [("spin", False), ("spin", True), ("yield", False), ("yield", True)]
WORDS = "cluster node pod engine token cache block prefill decode stream latency".split()



def medians(rows: list[tuple[float, ...]]) -> list[float]:
    """Each column's median over the rounds (one row a round: tokens/s, ITL p50, and step p50 in process)."""
    return [statistics.median(column) for column in zip(*rows)]

async def run(args) -> None:
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=MODEL, device="cpu"), show_progress=False)
    lib = cpu_decode.library()
    assert lib is not None, "the fused CPU decode step is not built (no compiler?)"
    steps: list[float] = []
    step = engine.step

    def timed_step():
        began = time.perf_counter()
        outputs = step()
        steps.append(time.perf_counter() - began)
        return outputs

    engine.step = timed_step  # type: ignore[method-assign]
    served = AsyncEngine(engine)
    served.start()
    rng, timer_on, gaps, stop = random.Random(1), [False], [], [False]

    async def timer() -> None:
        while not stop[0]:  # noqa: ASYNC110 -- the wake-ups are the point: the arm measures them
            await asyncio.sleep(0.001 if timer_on[0] else 0.05)

    async def client(i: int) -> None:
        n = 0
        while not stop[0]:
            prompt = f"Stream {i}.{n}: " + " ".join(rng.choice(WORDS) for _ in range(20))
            stream = await served.add_request(f"{i}-{n}", prompt,
                                              SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
            last = None
            async for _ in stream:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            n += 1

    tasks = [asyncio.create_task(timer()), *(asyncio.create_task(client(i)) for i in range(args.streams))]
    await asyncio.sleep(3)  # warm
    results: dict[tuple[str, bool], list[tuple[float, float, float]]] = {arm: [] for arm in ARMS}
    for r in range(args.rounds):
        for arm in ARMS:
            cpu_decode.set_pool_yield(lib, arm[0] == "yield")
            timer_on[0] = arm[1]
            gaps.clear()
            steps.clear()
            yields, load = cpu_decode.pool_yields(lib), os.getloadavg()[0]
            began = time.perf_counter()
            await asyncio.sleep(args.window)
            took = time.perf_counter() - began
            row = (len(gaps) / took, 1e3 * statistics.median(gaps) if gaps else float("nan"),
                   1e3 * statistics.median(steps) if steps else float("nan"))
            results[arm].append(row)
            print(f"round {r} pool={arm[0]:5} timer={'on' if arm[1] else 'off':3} tokens/s={row[0]:6.1f} "
                  f"ITL p50={row[1]:6.1f} ms step p50={row[2]:6.1f} ms yields={cpu_decode.pool_yields(lib) - yields} "
                  f"load1={load:.1f}", flush=True)
    stop[0] = True
    cpu_decode.set_pool_yield(lib, True)
    for task in tasks:
        task.cancel()
    await served.stop()
    base = medians(results[("spin", False)])
    print(f"\nmedian of {args.rounds} rounds ({args.threads} threads, {args.streams} streams, load1 now "
          f"{os.getloadavg()[0]:.1f}); ratios against pool=spin timer=off:")
    for arm in ARMS:
        med = medians(results[arm])
        print(f"  pool={arm[0]:5} timer={'on' if arm[1] else 'off':3} tokens/s={med[0]:6.1f} ({med[0] / base[0]:.2f}x) "
              f"ITL p50={med[1]:6.1f} ms ({med[1] / base[1]:.2f}x) step p50={med[2]:6.1f} ms ({med[2] / base[2]:.2f}x)")


def serve_with_timer(argv: list[str]) -> int:
    """`kaon serve argv` with a task on its event loop that sleeps 1 ms at a time (the --http arm)."""
    from kaon_runtime import cli
    from kaon_runtime.engine.async_engine import AsyncEngine

    start = AsyncEngine.start

    def start_with_timer(self) -> None:
        start(self)

        async def tick() -> None:
            while True:  # noqa: ASYNC110 -- the wake-ups are the point
                await asyncio.sleep(0.001)

        self._timer = asyncio.get_running_loop().create_task(tick())

    AsyncEngine.start = start_with_timer  # type: ignore[method-assign]
    return cli.main(["serve", *argv])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def http_run(args) -> None:
    import aiohttp

    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads),
           "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    engines: dict[str, tuple[subprocess.Popen, str]] = {}
    for arm in ("timer off", "timer on"):
        port = free_port()
        serve = ["--model", MODEL, "--port", str(port), "--device", "cpu", "--log-level", "warning"]
        command = ([sys.executable, __file__, "--serve-with-timer", *serve] if arm == "timer on"
                   else [sys.executable, "-m", "kaon_runtime.cli", "serve", *serve])
        engines[arm] = (subprocess.Popen(["taskset", "-c", args.cpus, *command], env=env,
                                         stdout=subprocess.DEVNULL), f"http://127.0.0.1:{port}")
    gaps: list[float] = []
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
            for proc, url in engines.values():
                while True:
                    if proc.poll() is not None:
                        raise SystemExit("an engine exited")
                    try:
                        async with session.get(url + "/ready") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.5)
            rng, target = random.Random(1), [""]

            async def client(i: int) -> None:
                n = 0
                while target[0]:
                    prompt = f"Stream {i}.{n}: " + " ".join(rng.choice(WORDS) for _ in range(20))
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True,
                            "ignore_eos": True}
                    url, last = target[0], None
                    async with session.post(url + "/v1/completions", json=body) as r:
                        async for now in text_arrivals(r):
                            if last is not None and url == target[0]:
                                gaps.append(now - last)
                            last = now
                    n += 1

            results: dict[str, list[tuple[float, float]]] = {arm: [] for arm in engines}
            for r in range(args.rounds):
                for arm, (_, url) in engines.items():
                    target[0] = url
                    clients = [asyncio.create_task(client(i)) for i in range(args.streams)]
                    await asyncio.sleep(2)  # the previous arm's streams drain meanwhile
                    gaps.clear()
                    load = os.getloadavg()[0]
                    began = time.perf_counter()
                    await asyncio.sleep(args.window)
                    took = time.perf_counter() - began
                    row = (len(gaps) / took, 1e3 * statistics.median(gaps) if gaps else float("nan"))
                    results[arm].append(row)
                    print(f"round {r} {arm:9} tokens/s={row[0]:6.1f} ITL p50={row[1]:6.1f} ms load1={load:.1f}",
                          flush=True)
                    target[0] = ""
                    await asyncio.gather(*clients)
                    target[0] = url
            base = medians(results["timer off"])
            print(f"\nmedian of {args.rounds} rounds (kaon serve on cpus {args.cpus}, {args.threads} threads, "
                  f"{args.streams} streams); ratios against timer off:")
            for arm in engines:
                med = medians(results[arm])
                print(f"  {arm:9} tokens/s={med[0]:6.1f} ({med[0] / base[0]:.2f}x) ITL p50={med[1]:6.1f} ms "
                      f"({med[1] / base[1]:.2f}x)")
    finally:
        for proc, _ in engines.values():
            proc.terminate()
        for proc, _ in engines.values():
            proc.wait(30)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve-with-timer":
        raise SystemExit(serve_with_timer(sys.argv[2:]))
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=float, default=5.0, help="seconds per arm per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2, help="torch's (and so the decode step's) threads")
    parser.add_argument("--http", action="store_true", help="two kaon serve processes, one with the 1 ms timer")
    parser.add_argument("--cpus", default="0,1", help="--http: the cores both engines are pinned to (taskset)")
    args = parser.parse_args()
    asyncio.run(http_run(args) if args.http else run(args))


if __name__ == "__main__":
    main()
