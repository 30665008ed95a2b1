"""Throughput with LoRA adapters against the base model alone, on the same requests, in one run.

    python bench/lora.py [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--rank 16] [--device cpu]
                         [--dtype bfloat16] [--torch-lora] [--torch-base]

The model is SmolLM2-135M (the embedded GGUF); the adapters are random, in PEFT's format, rank
--rank on all seven projections (q, k, v, o, gate, up, down: the heaviest case), written to a
temporary directory. Each run sends the same requests (greedy, ignore_eos) as one batch: to an
engine without LoRA, and to one engine with as many slots as the most adapters, with 1, 8 and 32
distinct adapters spread round-robin over the requests. The runs are interleaved over --rounds
passes and each row keeps its best, so a shared machine's load falls on all rows alike. Printed:
generated tokens per second and per CPU second of this process (the measure on a shared machine), the
ratio to the base, and the adapter registration time (reading and checking the files; copying into a slot
happens at the first step that needs it). Steps with adapters, prompt rows and decode rows, run in the fused
C step (kernels/cpu_decode.c) like the base's, in float32, float16 and bfloat16 models (--dtype; the slots
in the model's dtype). --torch-base adds the row "base, C step off" (torch's path for every step) for scale;
--torch-lora the row "N adapters, torch's path": an engine whose steps with adapters take torch's path, as a
float16 / bfloat16 model's did before the C step read half slots.
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


def run(llm: LLM, prompts, params, adapters) -> tuple[float, int, float]:
    """Wall seconds, generated tokens, CPU seconds of this process."""
    start, cpu = time.perf_counter(), time.process_time()
    outputs = llm.generate(prompts, params, use_tqdm=False, adapter=adapters)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs), cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="the model's dtype (float32, float16, bfloat16; default: LLM's)")
    parser.add_argument("--counts", default="1,8,32", help="distinct adapters per run")
    parser.add_argument("--rounds", type=int, default=2, help="passes over base and every count, the best kept")
    parser.add_argument("--torch-base", action="store_true", help="also the base with the fused C step off")
    parser.add_argument("--torch-lora", action="store_true",
                        help="also the most adapters with their steps on torch's path (the C step for the base's)")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    prompts = [[(7 * i + j) % 40000 + 100 for j in range(args.prompt_tokens)] for i in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    options = dict(show_progress=False, device=args.device, max_num_seqs=args.requests,
                   **({"dtype": args.dtype} if args.dtype else {}))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {args.dtype or 'default'}; "
          f"{args.requests} requests x "
          f"{args.prompt_tokens} prompt + {args.max_tokens} generated tokens; rank {args.rank} on {len(TARGETS)} "
          f"projections; best of {args.rounds} interleaved rounds")
    if args.torch_base:
        os.environ["KAON_CPU_DECODE"] = "off"
        cpu_decode.library.cache_clear()
        torch_base = LLM(MODEL, **options)
        run(torch_base, prompts[:2], params, None)
        seconds, tokens, _ = run(torch_base, prompts, params, None)
        print(f"base, C step off: {tokens / seconds:8.1f} tok/s ({seconds:.2f} s)")
        del torch_base, os.environ["KAON_CPU_DECODE"]
        cpu_decode.library.cache_clear()
    # Two engines side by side, the base alone and one with as many slots as the most adapters; their
    # runs interleaved, so that the load of a shared machine falls on every row alike.
    base = LLM(MODEL, **options)
    llm = LLM(MODEL, max_loras=max(counts), max_lora_rank=args.rank, **options)
    torch_lora = LLM(MODEL, max_loras=max(counts), max_lora_rank=args.rank, **options) if args.torch_lora else None
    if torch_lora is not None:
        step = torch_lora.engine.runner.model.model.cpu_decode
        assert step is not None, "the fused C step is off: --torch-lora compares against it"
        step.reads_lora = lambda: False  # models/decoder.py then sends the steps with adapters to torch
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(max(counts)):
            write_adapter(Path(tmp) / f"a{i}", base.engine.model_config, args.rank, i)
        start = time.perf_counter()
        for i in range(max(counts)):
            llm.engine.add_lora(f"a{i}", str(Path(tmp) / f"a{i}"))
        load_ms = (time.perf_counter() - start) * 1000 / max(counts)
        for i in range(max(counts)) if torch_lora is not None else ():
            torch_lora.engine.add_lora(f"a{i}", str(Path(tmp) / f"a{i}"))
    cases: dict[str, tuple[LLM, list[str | None] | None]] = {"base alone": (base, None)}
    for count in counts:
        cases[f"{count} adapters"] = (llm, [f"a{i % count}" for i in range(args.requests)])
    if torch_lora is not None:
        cases[f"{max(counts)} adapters, torch's path"] = (torch_lora, [f"a{i % max(counts)}"
                                                                        for i in range(args.requests)])
    for engine, names in cases.values():
        run(engine, prompts[:2], params, None if names is None else names[:2])  # warm-up
    best: dict[str, tuple[float, int, float]] = {}
    for _ in range(args.rounds):
        for label, (engine, names) in cases.items():
            seconds, tokens, cpu = run(engine, prompts, params, names)
            if label not in best or seconds < best[label][0]:
                best[label] = (seconds, tokens, cpu)
    base_rate = best["base alone"][1] / best["base alone"][0]
    base_cpu_rate = best["base alone"][1] / best["base alone"][2]
    for label, (seconds, tokens, cpu) in best.items():
        rate, cpu_rate = tokens / seconds, tokens / cpu
        print(f"{label:>11}: {rate:8.1f} tok/s ({seconds:.2f} s)  ratio to base {rate / base_rate:.2f}x;  "
              f"{cpu_rate:8.1f} tok per CPU s, ratio to base {cpu_rate / base_cpu_rate:.2f}x")
    print(f"adapter registration (read + check from local disk): {load_ms:.1f} ms per adapter")


if __name__ == "__main__":
    main()
