"""Perplexity of the bundled SmolLM2 on a fixed text, for each weight quantization.

The bundled GGUF is itself Q4_1, so the baseline "none" is that Q4_1 model dequantized to
float32. "int4" then takes the very same Q4_1 blocks (the engine's path for this file),
so it can only differ by float rounding; the int4 rows "requantized" quantize the
dequantized float weights afresh, which is what int4 does to a float (HF) checkpoint.

The text (bench/data/perplexity_sample.txt) is split into non-overlapping windows; each
window's first token is context only. Besides perplexity, "top-1 agree" is the share of
positions whose most likely next token equals the baseline's.

`--path decode` scores the text the way generation sees it: one token per step through the
engine's decode path (on CPU the fused C step, whose int8/int4 projections take int8-block
activations), instead of one prefill per window.

Usage: python bench/perplexity.py [--methods none int8 int4 fp8 int4-g32 int4-g64] [--window 1024]
                                  [--path prefill|decode]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runtime"))

from kaon_runtime import LLM  # noqa: E402
from kaon_runtime.config import KV_CACHE_DTYPES  # noqa: E402
from kaon_runtime.kernels.quant_gemm_cpu import dense_dtype  # noqa: E402
from kaon_runtime.layers.attention import AttentionMetadata, PrefillChunk  # noqa: E402
from kaon_runtime.quant import quantize_model  # noqa: E402

TEXT = ROOT / "bench" / "data" / "perplexity_sample.txt"
ENGINE_METHODS = ("none", "int8", "int4", "fp8")
REQUANTIZED = {"int4-g32": 32, "int4-g64": 64}  # int4 from the float weights, by group size


@torch.inference_mode()
def window_scores(runner, ids: list[int]) -> tuple[float, torch.Tensor]:
    """Summed negative log-likelihood of ids[1:] given the prefix, and the argmax at each position.

    The window runs as one prefill chunk over blocks 0..n of the idle engine's KV pool.
    """
    n = len(ids)
    device = runner.device
    blocks = torch.arange(-(-n // runner.block_size), device=device)
    meta = AttentionMetadata(slot_mapping=torch.arange(n, device=device), prefills=[PrefillChunk(0, n, n, blocks)])
    tokens = torch.tensor(ids, device=device)
    hidden = runner.model(tokens, torch.arange(n, device=device), meta)
    logits = runner.model.compute_logits(hidden[:-1])
    nll = torch.nn.functional.cross_entropy(logits, tokens[1:], reduction="sum")
    return nll.item(), logits.argmax(dim=-1).cpu()


@torch.inference_mode()
def window_scores_decoding(runner, ids: list[int]) -> tuple[float, torch.Tensor]:
    """As window_scores, but one decode step per token (a sequence of one, its context growing)."""
    n, device = len(ids), runner.device
    table = torch.arange(-(-n // runner.block_size), device=device)[None]
    nll, top1 = 0.0, []
    for t in range(n - 1):
        meta = AttentionMetadata(slot_mapping=torch.tensor([t], device=device), num_decode_tokens=1,
                                 decode_block_tables=table, decode_context_lens=torch.tensor([t + 1], device=device))
        hidden = runner.model(torch.tensor([ids[t]], device=device), torch.tensor([t], device=device), meta)
        logits = runner.model.compute_logits(hidden)
        nll += torch.nn.functional.cross_entropy(logits, torch.tensor([ids[t + 1]], device=device),
                                                 reduction="sum").item()
        top1.append(logits.argmax(dim=-1).cpu())
    return nll, torch.cat(top1)


def score(runner, windows: list[list[int]], path: str = "prefill") -> tuple[float, torch.Tensor]:
    scores = window_scores if path == "prefill" else window_scores_decoding
    total, predictions = 0.0, []
    for ids in windows:
        nll, top1 = scores(runner, ids)
        total += nll
        predictions.append(top1)
    count = sum(len(w) - 1 for w in windows)
    return math.exp(total / count), torch.cat(predictions)


def build_runner(method: str, kv_cache_dtype: str = "auto"):
    engine_method = method if method in ENGINE_METHODS else "none"
    runner = LLM(show_progress=False, device="cpu", dtype="float32", quantization=engine_method,
                 kv_cache_dtype=kv_cache_dtype).engine.runner
    if method in REQUANTIZED:
        quantize_model(runner.model, "int4", group_size=REQUANTIZED[method])
    return runner


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=[*ENGINE_METHODS, *REQUANTIZED],
                        choices=[*ENGINE_METHODS, *REQUANTIZED])
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--path", choices=("prefill", "decode"), default="prefill",
                        help="score each window in one prefill, or one decode step per token")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="the quantized methods' KV cache "
                             "(auto: float16 for int8/int4; the baseline keeps float32)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    torch.manual_seed(0)

    float_llm = LLM(show_progress=False, device="cpu", dtype="float32")
    ids = float_llm.tokenizer.encode(TEXT.read_text())
    windows = [ids[i:i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    print(f"text: {TEXT.relative_to(ROOT)}, {len(ids)} tokens in {len(windows)} windows of up to {args.window}")
    prefill_dtype = str(dense_dtype()).removeprefix("torch.")
    activations = {"prefill": f"{prefill_dtype} activations (a dense GEMM on the widened weight)",
                   "decode": "int8-block activations (the fused C decode step)"}[args.path]
    print(f'baseline "none": the bundled Q4_1 GGUF dequantized to float32, on CPU, scored through the '
          f'{args.path} path, where the int8 and int4 matmuls take {activations}\n')

    base_ppl, base_top1 = score(float_llm.engine.runner, windows, args.path)
    rows = []
    print(f"{'method':<10} {'perplexity':>10} {'vs none':>9} {'top-1 agree':>12}")
    for method in args.methods:
        runner = float_llm.engine.runner if method == "none" else build_runner(method, args.kv_cache_dtype)
        ppl, top1 = (base_ppl, base_top1) if method == "none" else score(runner, windows, args.path)
        increase = ppl / base_ppl - 1
        agree = (top1 == base_top1).float().mean().item()
        rows.append(dict(method=method, perplexity=ppl, relative_increase=increase, top1_agreement=agree))
        print(f"{method:<10} {ppl:>10.4f} {increase:>+8.2%} {agree:>12.2%}")
        del runner
    if args.json:
        args.json.write_text(json.dumps(dict(tokens=len(ids), window=args.window, path=args.path,
                                             kv_cache_dtype=args.kv_cache_dtype, results=rows), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
