"""Pipeline parallelism on CPU: what each stage holds, PP=2's throughput against PP=1 on the same cores, time to ready.

A random untied Llama-shaped model (transformers writes it; the bundled GGUF's vocabulary is its
tokenizer) is served by kaon at PP=1 (one process, all the cores) and at PP=2 (two processes, half the
cores each), with the same batch of greedy requests. Both run the torch path (KAON_CPU_DECODE=off: the
fused C decode step does not run under PP, and the ratio is meant to show the pipeline's own cost).

    .venv/bin/python bench/pipeline.py [--layers 8 --hidden 512 --requests 16 --max-tokens 32]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ["KAON_CPU_DECODE"] = "off"
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.loader import resolve_model
from kaon_runtime.loader.gguf_file import load_gguf

BUNDLED = "builtin://smollm2-135m-instruct"


def write_model(path: Path, layers: int, hidden: int) -> None:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                                      num_hidden_layers=layers, num_attention_heads=hidden // 64,
                                      num_key_value_heads=hidden // 128, max_position_embeddings=1024,
                                      bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.05)
    model.save_pretrained(path, safe_serialization=True)
    load_gguf(resolve_model(BUNDLED)).tokenizer.backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))


def run(path: str, pp: int, prompts: list[list[int]], params: SamplingParams, threads: int) -> dict:
    torch.set_num_threads(threads)  # the leader's share; each other rank takes cores // PP
    start = time.perf_counter()
    llm = LLM(path, show_progress=False, device="cpu", dtype="float32", pipeline_parallel_size=pp,
              kv_cache_bytes=256 * 2 ** 20, max_num_seqs=len(prompts))
    ready_s = time.perf_counter() - start
    try:
        llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)  # warm-up
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        engine = llm.engine
        weights = [engine.runner.weight_bytes] + getattr(engine, "worker_weight_bytes", [])
        kv = [engine.runner.kv_cache.numel() * engine.runner.kv_cache.element_size()]
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        return dict(pp=pp, ready_s=ready_s, tok_s=tokens / elapsed, weights=weights, kv_leader=kv[0],
                    blocks=engine.num_blocks, layers=len(engine.runner.model.layer_range),
                    tokens=[o.outputs[0].token_ids for o in outputs])
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    prompts = [[(97 * r + i) % 40000 + 100 for i in range(args.prompt_len)] for r in range(args.requests)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        write_model(Path(tmp), args.layers, args.hidden)
        cores = os.cpu_count() or 1
        one = run(tmp, 1, prompts, params, cores)
        two = run(tmp, 2, prompts, params, max(1, cores // 2))
        half = run(tmp, 1, prompts, params, max(1, cores // 2))  # a reference: one process on half the cores
    whole = one["weights"][0]
    print(f"model: {args.layers} layers, hidden {args.hidden}, untied, {whole / 2 ** 20:.1f} MiB of float32 weights; "
          f"{os.cpu_count()} cores; {args.requests} requests x {args.prompt_len} prompt + {args.max_tokens} tokens")
    for stage, held in enumerate(two["weights"]):
        print(f"PP=2 stage {stage}: weights {held / 2 ** 20:.1f} MiB = {held / whole:.3f} of the model "
              f"(goal <= {1 / 2 + 0.05:.2f})")
    print(f"KV pool, same byte budget: PP=1 {one['blocks']} blocks for {one['layers']} layers; PP=2 stage 0 "
          f"{two['blocks']} blocks (the smallest stage's) for {two['layers']} layers, "
          f"{two['kv_leader'] / 2 ** 20:.0f} MiB on the leader")
    print(f"greedy tokens identical: {one['tokens'] == two['tokens']}")
    print(f"time to ready: PP=1 {one['ready_s']:.1f}s, PP=2 {two['ready_s']:.1f}s")
    print(f"throughput: PP=1 {one['tok_s']:.1f} tok/s, PP=2 {two['tok_s']:.1f} tok/s, "
          f"ratio PP=2/PP=1 {two['tok_s'] / one['tok_s']:.2f}; PP=1 on half the cores {half['tok_s']:.1f} tok/s")


if __name__ == "__main__":
    main()
