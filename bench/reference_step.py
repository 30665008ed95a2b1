"""The reference mode's speed: the fused C step's reference kinds against torch's reference path (issue 49 §1/§2).

    python bench/reference_step.py [--formats gptq4 gptq8 gptq4-actorder] [--prompt 128] [--decode 32] [--rounds 2]

Each format is the bundled SmolLM2-135M-Instruct (its Q4_1 GGUF dequantized) packed as a GPTQ directory by the
tests' numpy writer (bench/packed_checkpoints.py), loaded with `dtype="float32"` (the reference mode: float32
activations times the exactly dequantized weights) in a fresh process per measurement, A and B alternated in one
run: "C step" (the fused step's REF_Q4 / REF_Q8_G16 kinds, the default now) and "torch" (KAON_CPU_DECODE=off:
torch's reference GEMMs, what the reference mode ran before; its answers moved with the batch). Figures are CPU
seconds of the measuring process (all its threads), so a loaded machine slows them less than wall time:
  prefill  one prompt of --prompt tokens, one output token: prompt tokens per CPU second;
  decode   --decode tokens after it at batch 1: generated tokens per CPU second (the prefill's share taken off).
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

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {"gptq4": dict(method="gptq", bits=4, group=64, sym=True),
           "gptq8": dict(method="gptq", bits=8, group=32, sym=False),
           "gptq4-actorder": dict(method="gptq", bits=4, group=64, sym=False, act_order=True)}


def child(directory: str, prompt: int, decode: int) -> dict:
    """One engine, the reference mode: CPU seconds of a prefill and of the decode after it."""
    sys.path.insert(0, str(ROOT / "runtime"))
    from kaon_runtime import LLM, SamplingParams

    ids = [(7 * i + 11) % 40000 + 100 for i in range(prompt)]
    with LLM(directory, show_progress=False, device="cpu", dtype="float32", enable_prefix_caching=False) as llm:
        def cpu(tokens: int) -> float:
            params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
            start = time.process_time()
            llm.generate([ids], params, use_tqdm=False)
            return time.process_time() - start

        cpu(1)  # warm: the C library, allocator, first-call costs
        prefill = cpu(1)
        whole = cpu(1 + decode)
        return dict(cpu_decode=bool(llm.engine.runner.kernels.cpu_decode), prefill_s=prefill,
                    decode_s=max(whole - prefill, 1e-9))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], int(args.child[1]), int(args.child[2]))))
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    sys.path.insert(0, str(ROOT / "runtime"))
    from packed_checkpoints import write_packed

    print(f"load {os.getloadavg()[0]:.1f}; prompt {args.prompt} tokens, decode {args.decode} at batch 1; "
          f"{args.rounds} rounds, A/B alternated, each in a fresh process")
    print(f"{'format':<16} {'path':<7} {'prefill tok/CPU-s':>18} {'decode tok/CPU-s':>17}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.formats:
            directory = Path(tmp) / name
            directory.mkdir()
            write_packed(directory, **FORMATS[name])
            runs: dict[str, list[dict]] = {"C step": [], "torch": []}
            for _ in range(args.rounds):
                for path in runs:
                    env = dict(os.environ, KAON_CPU_DECODE="off" if path == "torch" else "on")
                    out = subprocess.run([sys.executable, __file__, "--child", str(directory), str(args.prompt),
                                          str(args.decode)], env=env, capture_output=True, text=True, check=True)
                    result = json.loads(out.stdout.strip().splitlines()[-1])
                    assert result["cpu_decode"] == (path == "C step"), result
                    runs[path].append(result)
            rates = {}
            for path, results in runs.items():
                prefill = args.prompt / min(r["prefill_s"] for r in results)  # the best round: least disturbed
                decode = args.decode / min(r["decode_s"] for r in results)
                rates[path] = (prefill, decode)
                print(f"{name:<16} {path:<7} {prefill:>18.1f} {decode:>17.1f}", flush=True)
            (cp, cd), (tp, td) = rates["C step"], rates["torch"]
            print(f"{name:<16} {'ratio':<7} {cp / tp:>17.2f}x {cd / td:>16.2f}x   (load {os.getloadavg()[0]:.1f})",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
