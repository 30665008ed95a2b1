"""A one-thread prefill in steps of 256, 512 and 1,024 tokens: what each step costs beyond its tokens.

    python bench/prefill_steps.py [--rounds 3] [--tokens 1001] [--steps 256,512,1024] [--cpu 0]

Why: a prefill engine's step is its transfer's chunk (--disagg-chunk-tokens), and smaller chunks hide more of
the K/V move but made the prefill itself 1.8-2.1x slower on this CPU (docs/disaggregation.md). The profile
(torch profiler, one thread) named the fixed cost: every int4 weight widened to bfloat16 for the prefill's
dense GEMM on every call, by five torch ops (~20 ms per SmolLM2 layer against a ~6 ms GEMM at 256 rows).
kaon now widens it in one C pass (cpu_decode.c kaon_widen_q4_1, the same bits).

Two engine processes (in-process LLMEngine, the bundled int4 model, one thread, pinned to the same core), one
per arm: "c" (kaon's path) and "torch" (the widening as it was: dequantize_int4(...).to(dtype), patched in
this bench's child only). They take turns, one prompt per step size per round, so the machine's other load
falls on both alike. Prints each arm's median prefill time per step size and the ratio c / torch, and each
arm's ratio of the step sizes to one 1,024-token step (the chunking's cost).
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
import random, sys, time
import torch
torch.set_num_threads(1)
from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.sampling import SamplingParams
if sys.argv[1] == "torch":
    from kaon_runtime.kernels import cpu_decode
    from kaon_runtime.kernels.quant_gemm_ref import dequantize_int4
    cpu_decode.widen_q4_1 = lambda lib, packed, scales, mins, group, dtype: (
        dequantize_int4(packed, scales, mins, group).to(dtype))
engine = LLMEngine(EngineConfig(model="builtin://smollm2-135m-instruct", device="cpu", kv_cache_bytes=256 << 20),
                   show_progress=False)
rng = random.Random(1)
tokens = int(sys.argv[2])
print("ready", flush=True)
for line in sys.stdin:
    step = int(line)
    engine.scheduler.max_num_batched_tokens = step
    began = time.perf_counter()
    engine.add_request(f"p{rng.random()}", [rng.randrange(1000, 40000) for _ in range(tokens)],
                       SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished_requests():
        engine.step()
    print(f"{time.perf_counter() - began:.4f}", flush=True)
'''
ARMS = ("c", "torch")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1001)
    parser.add_argument("--steps", default="256,512,1024")
    parser.add_argument("--cpu", default="0")
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = {arm: subprocess.Popen(["taskset", "-c", args.cpu, sys.executable, "-c", CHILD, arm, str(args.tokens)],
                                   env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for arm in ARMS}
    times: dict[tuple[str, int], list[float]] = {(arm, step): [] for arm in ARMS for step in steps}
    try:
        for proc in procs.values():
            while (line := proc.stdout.readline()) and line.strip() != "ready":  # type: ignore[union-attr]
                pass
        for r in range(args.rounds):
            for step in steps:
                for arm, proc in procs.items():
                    proc.stdin.write(f"{step}\n")  # type: ignore[union-attr]
                    proc.stdin.flush()  # type: ignore[union-attr]
                    seconds = float(proc.stdout.readline())  # type: ignore[union-attr]
                    times[arm, step].append(seconds)
                    print(f"  round {r} step {step:5d} {arm:5s} {seconds:7.3f} s", flush=True)
    finally:
        for proc in procs.values():
            proc.stdin.close()  # type: ignore[union-attr]
            proc.wait(60)
    print(f"bench/prefill_steps.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  load average "
          f"{os.getloadavg()[0]:.1f} (the machine is shared with other work)")
    median = {key: statistics.median(v) for key, v in times.items()}
    widest = max(steps)
    for step in steps:
        c, t = median["c", step], median["torch", step]
        print(f"  {args.tokens}-token prefill in {step:5d}-token steps, 1 thread: c {c:6.3f} s, torch widening "
              f"{t:6.3f} s  (c / torch {c / t:.2f}x; vs one {widest}-token step: c {c / median['c', widest]:.2f}x, "
              f"torch {t / median['torch', widest]:.2f}x)")


if __name__ == "__main__":
    main()
