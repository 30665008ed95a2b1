"""Pipeline parallelism on CPU: what each stage holds, PP=2's throughput against PP=1 on the same cores, time to ready.

A random untied Llama-shaped model (transformers writes it; the bundled GGUF's vocabulary is its
tokenizer) is served by kaon at PP=1 (one process, all the cores) and at PP=2 (two processes, half the
cores each), with the same batch of greedy requests, in turns for a few rounds with both engines loaded
(PP=1; PP=2 with two micro-batches in flight; PP=2 with one; PP=1 on half the cores), so that other load on
a shared machine falls on all alike. Both run the torch path (KAON_CPU_DECODE=off: the ratio is meant to show
the pipeline's own cost, as it was first measured; bench/pipeline_c_step.py sets PP=2's C step against torch's).

    .venv/bin/python bench/pipeline.py [--layers 8 --hidden 512 --requests 16 --max-tokens 32 --rounds 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["KAON_CPU_DECODE"] = "off"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import torch
from random_llama import write_model

from kaon_runtime import LLM, SamplingParams

MATMUL_LOOP = """
import sys, time, torch
torch.set_num_threads(1)
a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
a @ b
start, n = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[1]):
    a @ b
    n += 1
print(n * 2 * 1024 ** 3 / (time.perf_counter() - start) / 1e9)
"""


def parallel_capacity(seconds: float = 4.0) -> tuple[float, float]:
    """GFLOP/s of one single-thread matmul process alone, and of two at once in all: what the machine
    gives two busy processes now (on a shared machine, often less than twice one)."""
    def run(count: int) -> float:
        procs = [subprocess.Popen([sys.executable, "-c", MATMUL_LOOP, str(seconds)], stdout=subprocess.PIPE, text=True)
                 for _ in range(count)]
        return sum(float(p.communicate()[0]) for p in procs)
    return run(1), run(2)


def load(path: str, pp: int, max_num_seqs: int) -> tuple[LLM, float]:
    start = time.perf_counter()
    llm = LLM(path, show_progress=False, device="cpu", dtype="float32", pipeline_parallel_size=pp,
              kv_cache_bytes=256 * 2 ** 20, max_num_seqs=max_num_seqs,
              enable_prefix_caching=False)  # every round computes its prompts again
    return llm, time.perf_counter() - start


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, threads: int,
          in_flight: int | None = None) -> tuple[float, list[list[int]]]:
    """Tokens per second of one batch on `threads` of this process's cores (PP=2: the leader's share; the
    other rank took cores // 2 when it started); `in_flight`: micro-batches kept in the pipeline."""
    torch.set_num_threads(threads)
    if in_flight is not None:
        assert llm.engine.in_flight is not None, "PP=2 keeps several micro-batches in flight"
        llm.engine.in_flight.depth = in_flight
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = [o.outputs[0].token_ids for o in outputs]
    return sum(map(len, tokens)) / elapsed, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3, help="PP=1 and PP=2 take turns this many times")
    args = parser.parse_args()
    prompts = [[(97 * r + i) % 40000 + 100 for i in range(args.prompt_len)] for r in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    cores = os.cpu_count() or 1
    half = max(1, cores // 2)
    runs: dict[str, list[float]] = {"pp1": [], "pp2": [], "pp2_one": [], "pp1_half": []}
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.layers, args.hidden)
        torch.set_num_threads(half)  # PP=2's other rank is spawned with cores // 2 threads; the leader gets as many
        two, two_ready = load(tmp, 2, args.requests)
        one, one_ready = load(tmp, 1, args.requests)
        try:
            for llm in (one, two):  # warm-up
                llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            identical = True
            alone, pair = parallel_capacity()
            # Interleaved, so that the other load on a shared machine falls on both alike.
            for _ in range(args.rounds):
                tok_s, expected = timed(one, prompts, params, cores)
                runs["pp1"].append(tok_s)
                tok_s, tokens = timed(two, prompts, params, half, in_flight=2)
                runs["pp2"].append(tok_s)
                identical &= tokens == expected
                tok_s, tokens = timed(two, prompts, params, half, in_flight=1)
                runs["pp2_one"].append(tok_s)
                identical &= tokens == expected
                runs["pp1_half"].append(timed(one, prompts, params, half)[0])
            weights = [two.engine.runner.weight_bytes] + two.engine.worker_weight_bytes
            whole = one.engine.runner.weight_bytes
            kv_leader = two.engine.runner.kv_cache.numel() * two.engine.runner.kv_cache.element_size()
            blocks = (one.engine.num_blocks, two.engine.num_blocks)
            layers = (len(one.engine.runner.model.layer_range), len(two.engine.runner.model.layer_range))
        finally:
            two.close()
    print(f"model: {args.layers} layers, hidden {args.hidden}, untied, {whole / 2 ** 20:.1f} MiB of float32 weights; "
          f"{cores} cores; {args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} tokens")
    for stage, held in enumerate(weights):
        print(f"PP=2 stage {stage}: weights {held / 2 ** 20:.1f} MiB = {held / whole:.3f} of the model "
              f"(goal <= {1 / 2 + 0.05:.2f})")
    print(f"KV pool, same byte budget: PP=1 {blocks[0]} blocks for {layers[0]} layers; PP=2 stage 0 "
          f"{blocks[1]} blocks (the smallest stage's) for {layers[1]} layers, "
          f"{kv_leader / 2 ** 20:.0f} MiB on the leader")
    print(f"greedy tokens identical (PP=2 with 2 and 1 micro-batches in flight vs PP=1): {identical}")
    print(f"time to ready: PP=1 {one_ready:.1f}s, PP=2 {two_ready:.1f}s")
    for name, label in (("pp1", f"PP=1, {cores} threads"), ("pp2", f"PP=2, {half} thread(s) per stage, 2 in flight"),
                        ("pp2_one", f"PP=2, {half} thread(s) per stage, 1 in flight"),
                        ("pp1_half", f"PP=1, {half} thread(s)")):
        print(f"throughput {label}: median {statistics.median(runs[name]):.1f} tok/s "
              f"(rounds: {', '.join(f'{x:.1f}' for x in runs[name])})")
    print(f"this machine now: one single-thread matmul process {alone:.1f} GFLOP/s, two at once {pair:.1f} GFLOP/s "
          f"in all ({pair / alone:.2f}x: what overlapping two stages can gain at most)")
    ratios = [b / a for a, b in zip(runs["pp1"], runs["pp2"])]
    print(f"ratio PP=2 (2 in flight) / PP=1 on the same {cores} cores: median {statistics.median(ratios):.2f} "
          f"(rounds: {', '.join(f'{r:.2f}' for r in ratios)}; goal >= 0.9); overlap's gain over 1 in flight: "
          f"{statistics.median(runs['pp2']) / statistics.median(runs['pp2_one']):.2f}x")


if __name__ == "__main__":
    main()
