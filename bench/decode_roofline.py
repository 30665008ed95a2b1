"""Batch-1 decode against the memory-bandwidth roofline, for each weight format, in one run.

    python bench/decode_roofline.py [--model random://llama-3.1-8b] [--quantization none int8 int4 fp8] [--profile]

Batch-1 decode reads every weight once per token, plus the context's KV cache, so a step
can take no less than bytes read / memory bandwidth. The bandwidth is measured in the same
run: a large device-to-device copy, (bytes read + bytes written) / time. For each weight
format the engine decodes N tokens after a short prompt (prefill subtracted: time(1 + N
tokens) - time(1 token), median of repeats); the figures are tokens/s, bytes read per
token, the bandwidth that implies and its fraction of the copy's.

The default model is Llama-3.1-8B's shape with random weights (random://): speed depends
on the shape, not on the values. On a GPU the engine runs its Triton kernels and CUDA
graphs; `--device cpu --model random://smollm2-135m --dtype float32` runs anywhere.

`--profile` also records a few decode steps of each format under torch's profiler and prints the
slowest format's top operators by device time: where a format misses the roofline, it says why.

A format written `int4:before` runs with kernels/quant_gemv.py switched off (the tl.dot kernels and
torch._scaled_mm that batch-1 decode ran before it), so one run gives the before/after pair;
`--gemv-tiles gemv.json` takes quant_gemv's tile table from a bench/gpu/gemv_sweep.py run.
"""
from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from throughput import decode_rate, sync_device

from kaon_runtime import LLM, SamplingParams


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 20) -> float:
    """Bytes per second moved by dst.copy_(src): each byte counts once read and once written."""
    # Filled, not empty: untouched CPU pages all map to one zero page, which reads from cache.
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.zeros_like(src)
    dst.copy_(src)  # warm-up: page faults, allocator
    sync_device(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync_device(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def bytes_per_token(llm: LLM, context_len: int) -> int:
    """What one batch-1 decode step reads: every weight but the token embedding (one row of it), and the
    K and V of `context_len` cached tokens in every layer."""
    runner = llm.engine.runner
    model, config = runner.model, runner.model_config
    head = model.lm_head
    # The lookup table, read one row per token: the embedding, or the float head it is tied to when the
    # logits come from the head's quantized copy (when they do not, the head reads all of it anyway).
    table = model.model.embed_tokens.weight if model.model.embed_tokens is not None else \
        head.weight_t if head.quantized is not None else None
    weights = runner.weight_bytes
    if table is not None:
        weights -= table.numel() * table.element_size()
        weights += config.hidden_size * table.element_size()
    itemsize = runner.kv_cache.element_size()
    kv = 2 * config.num_layers * config.num_kv_heads * config.head_dim * itemsize * context_len
    return weights + kv


def figures_of(llm: LLM, args, quantization: str) -> dict:
    """Decode rate, bytes read per token and the paths taken, for one loaded engine."""
    prompt = list(range(10, 10 + args.prompt_tokens))

    def generate(n):
        llm.generate([prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)

    rate = decode_rate(generate, args.tokens, args.repeats)
    read = bytes_per_token(llm, args.prompt_tokens + args.tokens // 2)  # the mean context over the decode
    graphs = llm.engine.runner.decode_graphs
    return {"quantization": quantization, "decode_tok_s": round(rate, 1), "ms_per_token": round(1e3 / rate, 3),
            "bytes_per_token": read, "achieved_gb_s": round(read * rate / 1e9, 1),
            "cuda_graphs": bool(graphs and graphs.capture),
            "attention_backend": llm.engine.runner.model.attention_layers()[0].backend.name}


def operator_table(llm: LLM, args, rows: int = 15) -> str:
    """The top operators of 16 batch-1 decode steps by device time (CPU time on a CPU)."""
    from torch.profiler import ProfilerActivity, profile
    on_gpu = torch.device(args.device).type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_gpu else [])
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with profile(activities=activities) as prof:
        llm.generate([list(range(10, 10 + args.prompt_tokens))], params, use_tqdm=False)
        sync_device(torch.device(args.device))
    return prof.key_averages().table(sort_by="cuda_time_total" if on_gpu else "cpu_time_total", row_limit=rows)


def measure(args, label: str) -> dict:
    from kaon_runtime.kernels import quant_gemv
    quantization, _, variant = label.partition(":")
    rows = quant_gemv.MAX_ROWS
    quant_gemv.MAX_ROWS = dict.fromkeys(rows, 0) if variant == "before" else rows  # read at each call
    try:
        llm = LLM(args.model, show_progress=False, device=args.device, dtype=args.dtype, quantization=quantization,
                  max_model_len=args.prompt_tokens + args.tokens + 8, max_num_seqs=1)
        figures = figures_of(llm, args, label)
        if args.profile:
            figures["profile"] = operator_table(llm, args)
    finally:
        quant_gemv.MAX_ROWS = rows
    llm.close()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the next format's weights need the room
    return figures


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="random://llama-3.1-8b")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8", "int4", "fp8"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256, help="decoded tokens per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth probe's buffer")
    parser.add_argument("--profile", action="store_true", help="print the slowest format's top operators")
    parser.add_argument("--gemv-tiles", type=Path, help="quant_gemv's tiles from a gemv_sweep.py JSON")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.gemv_tiles:
        from kaon_runtime.kernels import quant_gemv
        tiles = json.loads(args.gemv_tiles.read_text()).get("tiles", {})
        quant_gemv.configure({fmt: quant_gemv.Tile(**tile) for fmt, tile in tiles.items()})
        print(f"quant_gemv tiles from {args.gemv_tiles}: {tiles or 'none measured, defaults kept'}")

    bandwidth = copy_bandwidth(device, args.copy_mib << 20)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else \
        f"CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
    print(f"{name}: device-to-device copy {bandwidth / 1e9:.1f} GB/s ({args.model}, {args.dtype}, "
          f"batch 1, {args.tokens} tokens after a {args.prompt_tokens}-token prompt)")
    rows = []
    for quantization in args.quantization:
        try:
            row = measure(args, quantization)
        except Exception as exc:  # noqa: BLE001  one format's failure must not hide the others' figures
            print(f"{quantization:>11}: FAILED {type(exc).__name__}: {exc}", flush=True)
            rows.append({"quantization": quantization, "error": f"{type(exc).__name__}: {exc}"})
            continue
        row["roofline_fraction"] = round(row["achieved_gb_s"] * 1e9 / bandwidth, 3)
        rows.append(row)
        print(f"{quantization:>11}: {row['decode_tok_s']:8.1f} tok/s  {row['ms_per_token']:7.2f} ms/token  "
              f"{row['bytes_per_token'] / 1e9:6.2f} GB/token  {row['achieved_gb_s']:7.1f} GB/s  "
              f"{100 * row['roofline_fraction']:5.1f}% of the copy bandwidth  "
              f"(attention {row['attention_backend']}, CUDA graphs {'on' if row['cuda_graphs'] else 'off'})",
              flush=True)
    measured = [r for r in rows if "error" not in r]
    base = next((r for r in measured if r["quantization"] == "none"), None)
    for row in measured:
        if base is not None and row is not base:
            row["speedup_vs_none"] = round(row["decode_tok_s"] / base["decode_tok_s"], 2)
            print(f"{row['quantization']} vs none: {row['speedup_vs_none']}x tokens/s")
    if args.profile and measured:
        slowest = min(measured, key=lambda r: r["roofline_fraction"])
        print(f"profile of the format furthest from the roofline ({slowest['quantization']}):")
        print(slowest["profile"])
    if args.json:
        args.json.write_text(json.dumps({"device": name, "torch": torch.__version__,
                                         "copy_gb_s": round(bandwidth / 1e9, 1), "model": args.model,
                                         "dtype": args.dtype, "rows": rows}, indent=2))
    return 0 if len(measured) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
