"""Tensor parallelism on CPU: TP=2 through the fused C step against torch's path, tokens per CPU second.

A random untied Llama-shaped model (transformers writes it; the bundled GGUF's vocabulary is its tokenizer)
is served at TP=2 by two engines, each in a process of its own (whether the C step is built is decided once
per process): A, every rank's shard through the fused C step (the default), B, torch's path
(KAON_CPU_DECODE=off). With both loaded they run the same greedy batch in turns for a few rounds, so that
other load on a shared machine falls on both alike. The figure is generated tokens per CPU second of the
whole group (the engine's process and its worker's, every thread, from /proc), which a shared machine's other
work moves less than the wall clock, and per wall second. Rank 0's time inside the two sums a layer (the C
step's sum_ranks callback into TensorParallel.sum_in_rank_order, torch's TensorParallel.all_reduce) is
reported per step: the cost of reaching the collective from C, beside the collective itself.

    .venv/bin/python bench/tp_step.py [--layers 8 --hidden 512 --requests 8 --prompt 16 --max-tokens 32 --rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from random_llama import write_model


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far, every thread's (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def child(path: str, requests: int, prompt: int, max_tokens: int) -> None:
    """One engine at TP=2; on each line of stdin, a round: one JSON line of its figures."""
    from kaon_runtime import LLM, SamplingParams
    from kaon_runtime.distributed.parallel import TensorParallel

    in_sums = [0.0, 0]  # rank 0's wall seconds inside the layers' sums, and how many

    def timed(method):
        def wrapper(self, x):
            start = time.perf_counter()
            try:
                return method(self, x)
            finally:
                in_sums[0] += time.perf_counter() - start
                in_sums[1] += 1
        return wrapper

    TensorParallel.sum_in_rank_order = timed(TensorParallel.sum_in_rank_order)  # type: ignore[method-assign]
    TensorParallel.all_reduce = timed(TensorParallel.all_reduce)  # type: ignore[method-assign]
    llm = LLM(path, show_progress=False, device="cpu", dtype="float32", tensor_parallel_size=2,
              enable_prefix_caching=False)
    step = llm.engine.runner.model.model.cpu_decode
    worker = llm.engine.workers._procs[0].pid
    prompts = [[100 + 7 * i + j for j in range(prompt)] for i in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)  # warm
    print(json.dumps({"ready": True, "c_step": step is not None}), flush=True)
    for _ in sys.stdin:
        in_sums[:] = [0.0, 0]
        cpu0, worker0, wall0 = time.process_time(), cpu_seconds(worker), time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - wall0
        cpu = time.process_time() - cpu0 + cpu_seconds(worker) - worker0
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(json.dumps({"tokens": tokens, "cpu": cpu, "wall": wall, "in_sums": in_sums[0], "sums": in_sums[1],
                          "answer": outputs[0].outputs[0].token_ids[:8]}), flush=True)
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.requests, args.prompt, args.max_tokens)
        return
    print(f"load before: {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model"
        write_model(path, args.layers, args.hidden, intermediate=args.hidden * 3)
        command = [sys.executable, __file__, "--child", str(path), "--requests", str(args.requests),
                   "--prompt", str(args.prompt), "--max-tokens", str(args.max_tokens)]
        sides = {"C step": {}, "torch": {"KAON_CPU_DECODE": "off"}}
        procs = {name: subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                        env={**os.environ, **env}) for name, env in sides.items()}
        try:
            for name, proc in procs.items():
                assert proc.stdout is not None
                ready = json.loads(proc.stdout.readline())
                assert ready["c_step"] == (name == "C step"), (name, ready)
            runs: dict[str, list[dict]] = {name: [] for name in procs}
            for round_ in range(args.rounds):
                for name, proc in procs.items():
                    assert proc.stdin is not None and proc.stdout is not None
                    proc.stdin.write("run\n")
                    proc.stdin.flush()
                    run = json.loads(proc.stdout.readline())
                    runs[name].append(run)
                    print(f"round {round_} {name:7s}: {run['tokens']} tokens, {run['cpu']:.2f} CPU s, "
                          f"{run['wall']:.2f} wall s, {run['tokens'] / run['cpu']:.1f} tok/CPU s, "
                          f"{run['tokens'] / run['wall']:.1f} tok/s; rank 0 in {run['sums']} sums "
                          f"{run['in_sums'] * 1e3:.0f} ms; first answer {run['answer']}", flush=True)
        finally:
            for proc in procs.values():
                if proc.stdin is not None:
                    proc.stdin.close()
                proc.wait(timeout=120)
    print(f"load after: {os.getloadavg()}")
    print(f"model: {args.layers} layers, hidden {args.hidden}, float32, TP=2; {args.requests} requests of "
          f"{args.prompt} tokens, {args.max_tokens} out, greedy; {args.rounds} rounds in turns")
    totals = {name: {key: sum(r[key] for r in rs) for key in ("tokens", "cpu", "wall", "in_sums", "sums")}
              for name, rs in runs.items()}
    for name, t in totals.items():
        print(f"{name:7s}: {t['tokens'] / t['cpu']:.1f} tok per CPU s, {t['tokens'] / t['wall']:.1f} tok/s, "
              f"rank 0 in its sums {t['in_sums'] / t['sums'] * 1e6:.0f} us each, "
              f"{t['in_sums'] / t['wall'] * 100:.1f}% of the wall time")
    c, t = totals["C step"], totals["torch"]
    print(f"C step / torch: {(c['tokens'] / c['cpu']) / (t['tokens'] / t['cpu']):.2f}x per CPU second, "
          f"{(c['tokens'] / c['wall']) / (t['tokens'] / t['wall']):.2f}x per wall second")


if __name__ == "__main__":
    main()
