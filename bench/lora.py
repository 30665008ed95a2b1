"""Throughput with LoRA adapters against the base model alone, on the same requests, in one run.

    python bench/lora.py [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--rank 16] [--device cpu]

The model is SmolLM2-135M (the embedded GGUF); the adapters are random, in PEFT's format, rank
--rank on all seven projections (q, k, v, o, gate, up, down: the heaviest case), written to a
temporary directory. Each run sends the same requests (greedy, ignore_eos) as one batch: first
to an engine without LoRA, then with 1, 8 and 32 distinct adapters spread round-robin over the
requests (an engine with as many slots as adapters). Printed: generated tokens per second, the
ratio to the base, and the adapter load times (registration: reading and checking the files;
the first step that copies them into their slots is inside the timed run). A step with an
adapter leaves the fused C decode step for torch's path: the row "base, C step off" shows what
that alone costs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.loader.lora_adapter import projection_shapes

MODEL = "builtin://smollm2-135m-instruct"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(path: Path, config, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter for the model's shapes."""
    torch.manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for proj, (fan_in, fan_out) in projection_shapes(config).items():
            block = "mlp" if proj in ("gate_proj", "up_proj", "down_proj") else "self_attn"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"}))


def run(llm: LLM, prompts, params, adapters) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, adapter=adapters)
    elapsed = time.perf_counter() - start
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--counts", default="1,8,32", help="distinct adapters per run")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(show_progress=False, device=args.device, max_num_seqs=args.requests)
    base = LLM(MODEL, **options)
    config = base.engine.model_config
    run(base, prompts[:2], params, None)  # warm-up
    base_s, base_tokens = run(base, prompts, params, None)
    base_rate = base_tokens / base_s
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests x "
          f"{args.prompt_tokens} prompt + {args.max_tokens} generated tokens; rank {args.rank} on {len(TARGETS)} "
          "projections")
    print(f"base alone: {base_rate:8.1f} tok/s ({base_s:.2f} s)")
    del base
    os.environ["KAON_CPU_DECODE"] = "off"
    cpu_decode.library.cache_clear()
    torch_base = LLM(MODEL, **options)
    run(torch_base, prompts[:2], params, None)
    seconds, tokens = run(torch_base, prompts, params, None)
    print(f"base, C step off: {tokens / seconds:8.1f} tok/s ({seconds:.2f} s)  ratio to base "
          f"{tokens / seconds / base_rate:.2f}x")
    del torch_base, os.environ["KAON_CPU_DECODE"]
    cpu_decode.library.cache_clear()
    with tempfile.TemporaryDirectory() as tmp:
        dirs = {}
        for i in range(max(counts)):
            dirs[f"a{i}"] = str(Path(tmp) / f"a{i}")
            write_adapter(Path(dirs[f"a{i}"]), config, args.rank, i)
        for count in counts:
            llm = LLM(MODEL, max_loras=count, max_lora_rank=args.rank, **options)
            start = time.perf_counter()
            for i in range(count):
                llm.engine.add_lora(f"a{i}", dirs[f"a{i}"])
            load_ms = (time.perf_counter() - start) * 1000 / count
            names: list[str | None] = [f"a{i % count}" for i in range(args.requests)]
            run(llm, prompts[:2], params, names[:2])  # warm-up
            seconds, tokens = run(llm, prompts, params, names)
            rate = tokens / seconds
            print(f"{count:2d} adapters: {rate:8.1f} tok/s ({seconds:.2f} s)  ratio to base {rate / base_rate:.2f}x  "
                  f"load {load_ms:.1f} ms per adapter from local disk")
            del llm


if __name__ == "__main__":
    main()
