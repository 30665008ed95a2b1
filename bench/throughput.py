"""Offline throughput and batch-1 decode: kaon vs HF transformers, same model, same prompts, one run.

    python bench/throughput.py [--requests 64] [--device cpu] [--dtype float32]

Workload: 64 requests, prompt lengths uniform in 32-512 tokens, output lengths uniform
in 32-256 tokens, EOS ignored so both engines produce exactly the requested tokens.
HF runs the whole set as one padded batch through `generate` (static batching: every
row runs until the longest finishes), which is how HF serves a batch; only the tokens
each request asked for are counted as output.
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from kaon_runtime import LLM, SamplingParams  # noqa: E402
from kaon_runtime.loader import resolve_model  # noqa: E402

TEXT = ("The history of computing is a story of layers: transistors became gates, gates became "
        "processors, processors ran operating systems, and operating systems hosted languages that "
        "let people describe ever larger ideas. Each layer hid the one below it and made new work "
        "possible. Serving language models is the newest layer, and it has its own physics: memory "
        "bandwidth, cache reuse, and the art of keeping every core busy while requests come and go. ")


def make_workload(tokenizer, n: int, seed: int):
    rng = random.Random(seed)
    corpus = tokenizer.encode(TEXT * 20)
    prompts, outputs = [], []
    for _ in range(n):
        length, start = rng.randint(32, 512), rng.randint(0, 200)
        prompts.append(corpus[start:start + length])
        outputs.append(rng.randint(32, 256))
    return prompts, outputs


def bench_kaon(llm: LLM, prompts, output_lens) -> float:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in output_lens]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outputs] == output_lens
    return elapsed


def bench_hf(model, prompts, output_lens, pad_id: int) -> float:
    longest = max(map(len, prompts))
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, p in enumerate(prompts):  # left padding, as decoder-only generation needs
        ids[row, longest - len(p):] = torch.tensor(p)
        mask[row, longest - len(p):] = 1
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max(output_lens), min_new_tokens=max(output_lens),
                             do_sample=False, pad_token_id=pad_id)
    elapsed = time.perf_counter() - start
    assert out.shape[1] == longest + max(output_lens)
    return elapsed


def decode_rate(generate, new_tokens: int, repeats: int = 3) -> float:
    """Decode tokens/s at batch 1, prefill excluded: time(1 + N tokens) - time(1 token), median of repeats."""
    generate(4)  # warm-up
    rates = []
    for _ in range(repeats):
        t0 = time.perf_counter(); generate(1); t1 = time.perf_counter()
        generate(1 + new_tokens); t2 = time.perf_counter()
        rates.append(new_tokens / ((t2 - t1) - (t1 - t0)))
    return statistics.median(rates)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)

    llm = LLM(args.model, show_progress=False, device=args.device, dtype=args.dtype)
    prompts, output_lens = make_workload(llm.tokenizer, args.requests, args.seed)
    total_out = sum(output_lens)
    total_in = sum(map(len, prompts))

    from transformers import AutoModelForCausalLM
    path = resolve_model(args.model)
    if path.is_file():
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    hf = hf.to(args.device).eval()
    pad_id = llm.tokenizer.eos_token_id

    kaon_s = bench_kaon(llm, prompts, output_lens)
    hf_s = bench_hf(hf, prompts, output_lens, pad_id)

    one_prompt = prompts[0][:64]

    def kaon_one(n):
        llm.generate([one_prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    def hf_one(n):
        with torch.inference_mode():
            hf.generate(torch.tensor([one_prompt], device=args.device), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=pad_id)

    kaon_decode = decode_rate(kaon_one, args.decode_tokens)
    hf_decode = decode_rate(hf_one, args.decode_tokens)

    figures = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
                   f"device {args.device}, {args.dtype}",
        "requests": args.requests, "prompt_tokens": total_in, "output_tokens": total_out,
        "kaon_seconds": round(kaon_s, 2), "hf_seconds": round(hf_s, 2),
        "kaon_output_tok_s": round(total_out / kaon_s, 1), "hf_output_tok_s": round(total_out / hf_s, 1),
        "throughput_ratio": round(hf_s / kaon_s, 2),
        "kaon_batch1_decode_tok_s": round(kaon_decode, 1), "hf_batch1_decode_tok_s": round(hf_decode, 1),
        "decode_ratio": round(kaon_decode / hf_decode, 2),
    }
    print(f"workload: {args.requests} requests, {total_in} prompt tokens, {total_out} output tokens "
          f"({figures['machine']})")
    print(f"throughput  kaon {figures['kaon_output_tok_s']:8.1f} out tok/s ({kaon_s:.1f}s)   "
          f"hf {figures['hf_output_tok_s']:8.1f} out tok/s ({hf_s:.1f}s)   ratio {figures['throughput_ratio']}x")
    print(f"batch-1 decode  kaon {kaon_decode:.1f} tok/s   hf {hf_decode:.1f} tok/s   ratio "
          f"{figures['decode_ratio']}x")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
