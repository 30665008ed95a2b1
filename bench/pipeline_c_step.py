"""Pipeline parallelism on CPU: decode per CPU second at PP=2 with the fused C step in every stage, against
torch's path (KAON_CPU_DECODE=off), A/B in one run.

The random untied Llama-shaped model bench/pipeline.py writes (transformers; the bundled GGUF's vocabulary) is
served at PP=2 (two processes, one thread each on a 2-core machine) twice per round, once with the C step and once
on torch's path, in turns, so that other load on a shared machine falls on both alike. Two PP=2 engines cannot
live in one process at once (one default process group), so each turn builds its engine, times it and closes it;
the C library is asked for again after KAON_CPU_DECODE changes (its build is cached per process).

Each turn times, for the same greedy batch, a prefill-only run (max_tokens 1) and the full run; the decode tokens
(requests x (max_tokens - 1)) over the difference of their CPU seconds, counted over this process and every child
(the other stage's rank; spin-waits and gloo's waits included, they are the step's cost too), is "decode per CPU
second". Wall-clock tokens per second are printed beside it. Medians over the rounds, and the median of the
per-round ratios.

    .venv/bin/python bench/pipeline_c_step.py [--layers 8 --hidden 512 --requests 8 --max-tokens 64 --rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import cpu_decode

VARIANTS = {"c_step": "on", "torch": "off"}  # KAON_CPU_DECODE


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and all its children so far (the ranks are alive)."""
    me = psutil.Process()
    total = 0.0
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, float, list[list[int]]]:
    """(CPU seconds, wall seconds, tokens) of one batch."""
    cpu, wall = cpu_seconds(), time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return cpu_seconds() - cpu, time.perf_counter() - wall, [o.outputs[0].token_ids for o in outputs]


def turn(path: str, variant: str, prompts: list[list[int]], max_tokens: int) -> dict:
    os.environ["KAON_CPU_DECODE"] = VARIANTS[variant]  # read by this process's kernel choice and by the rank it spawns
    cpu_decode.library.cache_clear()
    with LLM(path, show_progress=False, device="cpu", dtype="float32", pipeline_parallel_size=2,
             kv_cache_bytes=256 * 2 ** 20, max_num_seqs=len(prompts), enable_prefix_caching=False) as llm:
        assert llm.engine.runner.cpu_decode_step == (variant == "c_step"), variant
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        prefill_cpu, prefill_wall, _ = timed(llm, prompts, SamplingParams(temperature=0, max_tokens=1))
        full_cpu, full_wall, tokens = timed(llm, prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                                         ignore_eos=True))
    decoded = len(prompts) * (max_tokens - 1)
    return {"decode_per_cpu_s": decoded / (full_cpu - prefill_cpu),
            "decode_per_s": decoded / (full_wall - prefill_wall), "tokens": tokens}


def main() -> None:
    from random_llama import write_model  # bench/pipeline.py's model

    os.environ.pop("KAON_CPU_DECODE", None)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    prompts = [[(97 * r + i) % 40000 + 100 for i in range(args.prompt_len)] for r in range(args.requests)]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))  # as the spawned rank takes: cores // 2
    runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.layers, args.hidden)
        for _ in range(args.rounds):
            for name in VARIANTS:
                runs[name].append(turn(tmp, name, prompts, args.max_tokens))
            load.append(os.getloadavg()[0])
    print(f"model: {args.layers} layers, hidden {args.hidden}, untied float32; PP=2 (1 thread per stage); "
          f"{args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} tokens; {args.rounds} rounds; "
          f"1-min load average {min(load):.1f}-{max(load):.1f}")
    for name, label in (("c_step", "fused C step"), ("torch", "torch's path")):
        per_cpu = [r["decode_per_cpu_s"] for r in runs[name]]
        print(f"{label}: decode {statistics.median(per_cpu):.1f} tok per CPU s "
              f"(rounds: {', '.join(f'{x:.1f}' for x in per_cpu)}); "
              f"{statistics.median(r['decode_per_s'] for r in runs[name]):.1f} tok/s wall")
    ratios = [a["decode_per_cpu_s"] / b["decode_per_cpu_s"] for a, b in zip(runs["c_step"], runs["torch"])]
    walls = [a["decode_per_s"] / b["decode_per_s"] for a, b in zip(runs["c_step"], runs["torch"])]
    same = sum(a == b for a, b in zip(runs["c_step"][0]["tokens"], runs["torch"][0]["tokens"]))
    print(f"C step / torch, decode per CPU second: median {statistics.median(ratios):.2f}x "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}); wall: median {statistics.median(walls):.2f}x")
    print(f"greedy sequences identical between the two paths: {same} of {args.requests} (other summation orders)")


if __name__ == "__main__":
    main()
