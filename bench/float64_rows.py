"""A float64 model on CPU: its rows-alone kernels (layers/rows_alone.py, the default: batch invariant) against torch's
float64 GEMMs and attention (KAON_CPU_PREFILL=torch: what every float64 model ran before), A/B in one run.

Each mode loads the model in a child process of its own (the choice is made at load), and the children alternate,
ABAB..., so a machine shared with other work loads both alike. Figures: prefill tokens/s (one prompt of --prompt
tokens, one token out), decode tokens/s at batch 1 and at --batch (the steps after the first token), each as wall
tokens/s and as tokens per CPU second of the child (its threads included: the figure least moved by other load).

    python bench/float64_rows.py [--model builtin://smollm2-135m-instruct] [--prompt 256] [--tokens 32] [--repeats 2]
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

MODES = {"rows-alone": {}, "torch": {"KAON_CPU_PREFILL": "torch"}}


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def child(args: argparse.Namespace) -> dict:
    from kaon_runtime import LLM, SamplingParams
    llm = LLM(args.model, show_progress=False, device="cpu", dtype="float64", enable_prefix_caching=False)
    prompt = [(17 * i) % 20000 + 100 for i in range(args.prompt)]
    short = [[(31 * i + j) % 20000 + 100 for i in range(16)] for j in range(args.batch)]

    def timed(prompts, tokens):
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        wall, cpu = time.perf_counter(), _cpu()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - wall, _cpu() - cpu

    timed([prompt[:8]], 2)  # warm
    figures = {}
    wall, cpu = timed([prompt], 1)
    figures["prefill"] = (args.prompt / wall, args.prompt / cpu)
    for name, prompts in (("decode-1", short[:1]), (f"decode-{args.batch}", short)):
        first_wall, first_cpu = timed(prompts, 1)
        wall, cpu = timed(prompts, args.tokens + 1)
        steps = args.tokens * len(prompts)
        figures[name] = (steps / (wall - first_wall), steps / (cpu - first_cpu))
    llm.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--child", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    results: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for repeat in range(args.repeats):
        for mode, env in MODES.items():
            load = os.getloadavg()[0]
            command = [sys.executable, __file__, "--child", mode, "--model", args.model, "--prompt", str(args.prompt),
                       "--tokens", str(args.tokens), "--batch", str(args.batch)]
            out = subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, check=True)
            figures = json.loads(out.stdout.strip().splitlines()[-1])
            results[mode].append(figures)
            print(f"repeat {repeat} {mode:10s} load {load:.1f}: " + ", ".join(
                f"{name} {wall:.1f} tok/s ({cpu:.1f} per CPU s)" for name, (wall, cpu) in figures.items()),
                flush=True)
    for name in results["torch"][0]:
        best = {mode: max(r[name][1] for r in runs) for mode, runs in results.items()}
        wall = {mode: max(r[name][0] for r in runs) for mode, runs in results.items()}
        print(f"{name}: rows-alone / torch = {best['rows-alone'] / best['torch']:.2f}x per CPU second, "
              f"{wall['rows-alone'] / wall['torch']:.2f}x wall (best of {args.repeats})")


if __name__ == "__main__":
    main()
