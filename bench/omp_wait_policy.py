"""OMP_WAIT_POLICY=passive against libgomp's default for a two-thread CPU engine (the aggregated engine of
bench/disagg.py): a 1,000-token prefill and the decode steps of 4 sequences.

    python bench/omp_wait_policy.py [--rounds 5] [--threads 2] [--cpus 0,1]

Two engine processes (in-process LLMEngine, the bundled model), one per arm, both pinned to the same cores with
the same thread count, loaded once; then the arms take turns, one prompt each per round, so whatever else runs
on the machine falls on both alike. libgomp's threads spin at the end of each parallel region by default
(GOMP_SPINCOUNT) and sleep at once when passive; torch's prefill matmuls run in such regions. Prints each arm's
median prefill time and median decode step, and the ratio passive / default.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = r'''
import random, statistics, sys, time
from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.sampling import SamplingParams
engine = LLMEngine(EngineConfig(model="builtin://smollm2-135m-instruct", device="cpu", kv_cache_bytes=256 << 20),
                   show_progress=False)
rng = random.Random(1)
print("ready", flush=True)
for line in sys.stdin:
    r = line.strip()
    began = time.perf_counter()
    engine.add_request("p" + r, [rng.randrange(1000, 40000) for _ in range(1001)],
                       SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    prefill = time.perf_counter() - began
    for i in range(4):
        engine.add_request(f"d{r}-{i}", [rng.randrange(1000, 40000) for _ in range(20)],
                           SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    steps = []
    while engine.has_unfinished_requests():
        began = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - began)
    print(f"{prefill:.4f} {statistics.median(steps):.5f}", flush=True)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--cpus", default="0,1")
    args = parser.parse_args()
    arms = {}
    for name, policy in (("default", {}), ("passive", {"OMP_WAIT_POLICY": "passive"})):
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), **policy,
               "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        if not policy:  # libgomp's default, whatever this shell set
            env.pop("OMP_WAIT_POLICY", None)
        arms[name] = subprocess.Popen(["taskset", "-c", args.cpus, sys.executable, "-c", CHILD], env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in arms}
    try:
        for proc in arms.values():
            while (line := proc.stdout.readline()) and line.strip() != "ready":  # type: ignore[union-attr]
                pass
        for r in range(args.rounds):
            for name, proc in arms.items():
                proc.stdin.write(f"{r}\n")  # type: ignore[union-attr]
                proc.stdin.flush()  # type: ignore[union-attr]
                prefill, step = map(float, proc.stdout.readline().split())  # type: ignore[union-attr]
                results[name].append((prefill, step))
                print(f"  round {r} {name:8s} prefill {prefill:7.3f} s  decode step {step * 1000:7.1f} ms", flush=True)
    finally:
        for proc in arms.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(60)
    print(f"bench/omp_wait_policy.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  load average "
          f"{os.getloadavg()[0]:.1f} (the machine is shared with other work)")
    medians = {name: (statistics.median(p for p, _ in rows), statistics.median(s for _, s in rows))
               for name, rows in results.items()}
    for name, (prefill, step) in medians.items():
        print(f"  {name:8s} {args.threads} threads on cores {args.cpus}: 1,000-token prefill p50 {prefill:.3f} s, "
              f"decode step (4 sequences) p50 {step * 1000:.1f} ms")
    (dp, ds), (pp, ps) = medians["default"], medians["passive"]
    print(f"  passive / default: prefill {pp / dp:.2f}x, decode step {ps / ds:.2f}x")


if __name__ == "__main__":
    main()
