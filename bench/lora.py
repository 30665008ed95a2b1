"""Throughput with LoRA adapters against the base model alone, on the same requests, in one run.

    python bench/lora.py [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--rank 16] [--device cpu]

The model is SmolLM2-135M (the embedded GGUF); the adapters are random, in PEFT's format, rank
--rank on all seven projections (q, k, v, o, gate, up, down: the heaviest case), written to a
temporary directory. Each run sends the same requests (greedy, ignore_eos) as one batch: to an
engine without LoRA, and to one engine with as many slots as the most adapters, with 1, 8 and 32
distinct adapters spread round-robin over the requests. The runs are interleaved over --rounds
passes and each row keeps its best, so a shared machine's load falls on all rows alike. Printed:
generated tokens per second, the ratio to the base, and the adapter registration time (reading
and checking the files; copying into a slot happens at the first step that needs it). Decode
steps with adapters run in the fused C decode step (kernels/cpu_decode.c) like the base's;
prefill chunks take torch's path with or without them. --torch-base adds the row "base, C step
off" (torch's path for every step) for scale.
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
    parser.add_argument("--rounds", type=int, default=2, help="passes over base and every count, the best kept")
    parser.add_argument("--torch-base", action="store_true", help="also the base with the fused C step off")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(show_progress=False, device=args.device, max_num_seqs=args.requests)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; {args.requests} requests x "
          f"{args.prompt_tokens} prompt + {args.max_tokens} generated tokens; rank {args.rank} on {len(TARGETS)} "
          f"projections; best of {args.rounds} interleaved rounds")
    if args.torch_base:
        os.environ["KAON_CPU_DECODE"] = "off"
        cpu_decode.library.cache_clear()
        torch_base = LLM(MODEL, **options)
        run(torch_base, prompts[:2], params, None)
        seconds, tokens = run(torch_base, prompts, params, None)
        print(f"base, C step off: {tokens / seconds:8.1f} tok/s ({seconds:.2f} s)")
        del torch_base, os.environ["KAON_CPU_DECODE"]
        cpu_decode.library.cache_clear()
    # Two engines side by side, the base alone and one with as many slots as the most adapters; their
    # runs interleaved, so that the load of a shared machine falls on every row alike.
    base = LLM(MODEL, **options)
    llm = LLM(MODEL, max_loras=max(counts), max_lora_rank=args.rank, **options)
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(counts)):
            write_adapter(Path(tmp) / f"a{i}", base.engine.model_config, args.rank, i)
        start = time.perf_counter()
        for i in range(max(counts)):
            llm.engine.add_lora(f"a{i}", str(Path(tmp) / f"a{i}"))
        load_ms = (time.perf_counter() - start) * 1000 / max(counts)
    cases: dict[str, tuple[LLM, list[str | None] | None]] = {"base alone": (base, None)}
    for count in counts:
        cases[f"{count} adapters"] = (llm, [f"a{i % count}" for i in range(args.requests)])
    for engine, names in cases.values():
        run(engine, prompts[:2], params, None if names is None else names[:2])  # warm-up
    best: dict[str, tuple[float, int]] = {}
    for _ in range(args.rounds):
        for label, (engine, names) in cases.items():
            seconds, tokens = run(engine, prompts, params, names)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, tokens)
    base_rate = best["base alone"][1] / best["base alone"][0]
    for label, (seconds, tokens) in best.items():
        rate = tokens / seconds
        print(f"{label:>11}: {rate:8.1f} tok/s ({seconds:.2f} s)  ratio to base {rate / base_rate:.2f}x")
    print(f"adapter registration (read + check from local disk): {load_ms:.1f} ms per adapter")


if __name__ == "__main__":
    main()
