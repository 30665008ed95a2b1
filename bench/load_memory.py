"""Peak and settled resident memory of loading quantized models, this tree against a baseline (issue 49 §3).

    python bench/load_memory.py [--baseline PATH] [--models bundled Q4_K_M float32]

Each load runs in a fresh process (tests/support/load_memory.py: KV pool fixed at 64 blocks, one short
greedy request; peak = VmHWM, settled = resident memory after the request). Models: the bundled
SmolLM2-135M Q4_1 GGUF (kept as its own blocks), SmolLM2 as Q4_K_M made from it by llama.cpp's quantizer
(bench/gguf_decode.py's make_file), and the bundled file dequantized (`dtype=float32`, not a quantized
format: shown for scale). --baseline PATH runs the same loads with another checkout's runtime/ (e.g. a
worktree of the commit before a change), alternating with this tree. The goal: peak <= 1.15x settled for
every quantized format.
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
    parser.add_argument("--models", nargs="+", default=["bundled", "Q4_K_M", "float32"],
                        choices=["bundled", "Q4_K_M", "float32"])
    args = parser.parse_args()
    from kaon_runtime.loader import resolve_model

    bundled = str(resolve_model("builtin://smollm2-135m-instruct"))
    models = {"bundled": (bundled,), "float32": (bundled, "dtype=float32")}
    if "Q4_K_M" in args.models:
        from gguf_decode import make_file

        models["Q4_K_M"] = (str(make_file("Q4_K_M")),)
    trees = [("this tree", ROOT / "runtime")] + ([("baseline", args.baseline / "runtime")] if args.baseline else [])
    print(f"{'model':<9} {'tree':<10} {'peak MiB':>9} {'settled MiB':>12} {'peak/settled':>13} {'load s':>7}")
    for name in args.models:
        for tree, runtime in trees:
            found = measure(runtime, *models[name])
            print(f"{name:<9} {tree:<10} {found['peak'] / 2 ** 20:>9.0f} {found['settled'] / 2 ** 20:>12.0f} "
                  f"{found['peak'] / found['settled']:>13.2f} {found['seconds']:>7.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
