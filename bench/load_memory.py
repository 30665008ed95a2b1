"""Peak and settled resident memory of loading quantized models, this tree against a baseline (issue 49 §3).

    python bench/load_memory.py [--baseline PATH] [--models bundled Q4_K_M ... float32]

Each load runs in a fresh process (tests/support/load_memory.py: KV pool fixed at 64 blocks, one short
greedy request; peak = VmHWM, settled = resident memory after the request). Models, every quantized format
kaon loads, all SmolLM2-135M-Instruct:
  bundled        the bundled Q4_1 GGUF (kept as its own blocks)
  Q8_0 Q4_K_M Q5_K_M
                 GGUF files made from it by llama.cpp's quantizer (bench/gguf_decode.py's make_file)
  W4A16 W8A16 FP8-dynamic W8A8
                 compressed-tensors checkpoints written by compressed-tensors' own compressor from its
                 dequantized float weights (bench/quant_reference.py's writer: pack-quantized int4 group64
                 asym, pack-quantized int8 per channel, float-quantized FP8 per channel with dynamic per-token
                 FP8 inputs, int-quantized int8 with dynamic per-token int8 inputs)
  GPTQ AWQ       4-bit group64 asym, packed by the tests' numpy writer (bench/packed_checkpoints.py; not by
                 gptqmodel / autoawq, which do not build here: the same tensor layout and config keys)
  int8 int4 fp8  the bundled file under `--quantization int8` / `int4` / `fp8`: kaon quantizes a float model itself,
                 each linear as its weights arrive (quant/on_load.py; until 2026-11-30 the whole float model was
                 built first and these peaked at 1.5-1.8x)
  int8-st int4-st fp8-st
                 the same from a float32 safetensors directory of the bundled model (bench/quant_reference.py's
                 write_float, 540 MB, written once): a float checkpoint as most are published, memory-mapped
  GPTQ-MoE       a random Qwen3-MoE (4 layers, 16 experts 768 wide, hidden 512), GPTQ 4-bit g32 (bench/
                 quantized_experts.py's writer): a quantized checkpoint whose experts are most of its bytes
  float32        the bundled file dequantized (`dtype=float32`, not a quantized format: shown for scale)
The checkpoints are written once into bench/out/load_memory/. --baseline PATH runs the same loads with another
checkout's runtime/ (e.g. a worktree of the commit before a change), alternating with this tree. The goal
(issue 49 section 3): peak <= 1.15x settled for every quantized format; the last column says whether it holds.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))
SCRIPT = ROOT / "tests" / "support" / "load_memory.py"
OUT = ROOT / "bench" / "out" / "load_memory"
GGUF_TYPES = ("Q8_0", "Q4_K_M", "Q5_K_M")
SAFETENSORS = ("W4A16", "W8A16", "FP8-dynamic", "W8A8", "GPTQ", "AWQ")
REQUANTIZED = ("int8", "int4", "fp8")  # --quantization of the bundled file: quantized from float as it loads
FROM_FLOAT = tuple(f"{method}-st" for method in REQUANTIZED)  # --quantization of a float32 safetensors directory
MODELS = ("bundled", *GGUF_TYPES, *SAFETENSORS, *REQUANTIZED, *FROM_FLOAT, "GPTQ-MoE", "float32")
GOAL = 1.15


def checkpoint_dir(name: str) -> Path:
    """A safetensors checkpoint of `name`'s format, written once (bench/quant_reference.py's writer)."""
    from quant_reference import write

    from kaon_runtime.loader import resolve_model

    target = OUT / name
    if not (target / "config.json").exists():
        import shutil

        OUT.mkdir(parents=True, exist_ok=True)
        staging = OUT / f".{name}.tmp"  # the writer also leaves a float directory beside it: both removed
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        if name == "float-safetensors":
            from quant_reference import write_float

            written = staging
            write_float(written)
        elif name == "GPTQ-MoE":
            from quantized_experts import write_dirs

            written, _ = write_dirs(staging, experts=16, layers=4)
        else:
            written = staging / name
            write(name, written, resolve_model("builtin://smollm2-135m-instruct"))
        written.rename(target)
        shutil.rmtree(staging, ignore_errors=True)
    return target


def measure(runtime: Path, model: str, *options: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(runtime)}
    done = subprocess.run([sys.executable, str(SCRIPT), model, *options], env=env, capture_output=True, text=True,
                          timeout=900, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{model}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    args = parser.parse_args()
    from kaon_runtime.loader import resolve_model

    bundled = str(resolve_model("builtin://smollm2-135m-instruct"))
    models = {"bundled": (bundled,), "float32": (bundled, "dtype=float32"),
              **{name: (bundled, f"quantization={name}") for name in REQUANTIZED}}
    for name in args.models:  # files first: the writers hold a float model, the loads measured below must not
        if name in GGUF_TYPES:
            from gguf_decode import make_file

            models[name] = (str(make_file(name)),)
        elif name in (*SAFETENSORS, "GPTQ-MoE"):
            models[name] = (str(checkpoint_dir(name)),)
        elif name in FROM_FLOAT:
            models[name] = (str(checkpoint_dir("float-safetensors")), f"quantization={name.removesuffix('-st')}")
    trees = [("this tree", ROOT / "runtime")] + ([("baseline", args.baseline / "runtime")] if args.baseline else [])
    print(f"{'model':<12} {'tree':<10} {'peak MiB':>9} {'settled MiB':>12} {'peak/settled':>13} {'load s':>7}  "
          f"goal <= {GOAL}x")
    worst = 0.0
    for name in args.models:
        for tree, runtime in trees:
            found = measure(runtime, *models[name])
            ratio = found["peak"] / found["settled"]
            verdict = "(not quantized)" if name == "float32" else "ok" if ratio <= GOAL else "OVER"
            if name != "float32" and tree == "this tree":
                worst = max(worst, ratio)
            print(f"{name:<12} {tree:<10} {found['peak'] / 2 ** 20:>9.0f} {found['settled'] / 2 ** 20:>12.0f} "
                  f"{ratio:>13.2f} {found['seconds']:>7.1f}  {verdict}", flush=True)
    print(f"worst quantized format: {worst:.2f}x (goal {GOAL}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
