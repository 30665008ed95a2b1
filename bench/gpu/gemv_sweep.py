"""Decode's matrix-vector products on a GPU: each weight format's kernel against cuBLAS bf16, per tile shape.

    python bench/gpu/gemv_sweep.py --json gemv.json [--dry-run]

The first GPU run (bench/RESULTS.md, 2026-11-26, H200) found batch-1 decode of Llama-3.1-8B's
shape slower in int8 (1.04x bf16) and int4 (0.44x) than their bytes promise (2x and ~3.5x), and
its profile put 90% of int4's time in _w4a16_kernel. This sweep times, for M = 1 on that model's
four projection shapes, bf16 F.linear (cuBLAS), fp8 through torch._scaled_mm (and its activation
quantization alone), and the W8A16 / W4A16 Triton kernels over tile shapes (BLOCK_N, BLOCK_K,
split-K). (A W4A16 variant that widened several groups per step to bf16 in registers was tried in
the same run: 0.42-0.53x bf16, little better than the default and inexact; it is in bench/history.) Each timing is
the device time of one call inside a captured CUDA graph that runs the call over enough weight
copies to overflow the L2 cache (so weights come from memory, as in decode), and each variant's
output is checked against the torch reference first.

`--dry-run`: tiny shapes on the CPU through Triton's interpreter (the script proven, no timings).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv or os.environ.get("KAON_GPU_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))

import triton  # noqa: E402
from gemv_candidates import w4a16_gemv  # noqa: E402

from kaon_runtime.kernels import quant_gemm as qg  # noqa: E402
from kaon_runtime.kernels.quant_gemm_ref import w4a16_matmul_ref, w8a16_matmul_ref  # noqa: E402
from kaon_runtime.quant.fp8 import fp8_matmul_scaled_mm, quantize_fp8  # noqa: E402

# Llama-3.1-8B: q|k|v, o, gate|up, down as (N, K).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 32  # kaon's int4 group (GGUF Q4_1's)

L2_FLUSH_BYTES = 256 << 20


def device_time_us(fn_per_copy, copies: int) -> float:
    """Microseconds per call: a graph of `copies` calls (one per weight copy), replayed, timed by events."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(copies):  # warm-up outside the graph: compilation, allocator
            fn_per_copy(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            fn_per_copy(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / copies)
    return sorted(times)[len(times) // 2]


def variants():
    """(format, label, kwargs for the call) to try; the first of each format is today's default."""
    yield "int8", "default", {}
    for bn, bk in itertools.product((32, 64, 128), (256, 512)):
        yield "int8", f"n{bn}-k{bk}", {"block_n": bn, "BLOCK_K": bk}
    yield "int4", "default", {}
    for bn in (32, 128):
        yield "int4", f"n{bn}", {"block_n": bn}
    for bn, groups in itertools.product((16, 32, 64), (4, 8)):  # gemv_candidates.py
        yield "int4", f"gemv n{bn}-g{groups}", {"gemv": True, "block_n": bn, "groups_per_step": groups}


def call(fmt: str, x, w, options: dict, split_k: int | None):
    if not options and split_k is None and w[0].dtype != torch.float8_e4m3fn:  # what the engine runs today
        return qg.w8a16_matmul(x, *w) if fmt == "int8" else qg.w4a16_matmul(x, *w, GROUP)
    if fmt == "int8":
        qweight, scales = w
        block_k = options.get("BLOCK_K", qg._BLOCK_K)
        opts = {"BLOCK_K": qg._BLOCK_K} | options
        return qg._launch(qg._w8a16_kernel, x, (qweight, scales), (qweight.stride(0),), qweight.shape[0],
                          triton.cdiv(x.shape[1], block_k), split_k, **opts)
    packed, scales, mins = w
    if options.get("gemv"):
        return w4a16_gemv(x, packed, scales, mins, GROUP, options["block_n"], options["groups_per_step"], split_k)
    return qg._launch(qg._w4a16_kernel, x, (packed, scales, mins), (packed.stride(0), scales.stride(0)),
                      packed.shape[0], x.shape[1] // GROUP, split_k, GROUP=GROUP, **options)


def weights_of(fmt: str, n: int, k: int, device, group: int = GROUP):
    if fmt == "int8":
        return (torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device),
                torch.rand(n, device=device) / 100)
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device),
            (torch.rand(n, k // group, device=device) / 50).half(),
            (-torch.rand(n, k // group, device=device) / 7).half())


def checkpoint_formats(x: torch.Tensor, n: int, k: int, copies: int, timer) -> dict:
    """What issue 36's GPU goals compare, at the kernel: W4A16 in AWQ/GPTQ's usual groups of 128 (they
    load into kaon's int4 layout, g_idx reordered once) against kaon's own groups of 32, and
    DeepSeek/Qwen3-style FP8 with 128 x 128 block scales (Fp8BlockLinear) against per-channel fp8."""
    from kaon_runtime.quant.fp8_block import Fp8BlockLinear
    rows: dict = {}
    pool = [weights_of("int4", n, k, x.device, 128) for _ in range(copies)]
    rows["int4 g128 (AWQ/GPTQ) default"] = {"us": timer(lambda i: qg.w4a16_matmul(x, *pool[i], 128), copies)}
    pool.clear()
    blocks = [Fp8BlockLinear(quantize_fp8(torch.randn(n, k, device=x.device, dtype=x.dtype) / 64)[0],
                             torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=x.device) / 100, (128, 128))
              for _ in range(max(1, copies // 2))]
    rows["fp8 block128 (Fp8BlockLinear)"] = {"us": timer(lambda i: blocks[i % len(blocks)].matmul(x), copies)}
    return rows


def reference(fmt: str, x, w):
    return w8a16_matmul_ref(x, *w) if fmt == "int8" else w4a16_matmul_ref(x, *w, GROUP)


def sweep_shape(n: int, k: int, device: torch.device, dtype: torch.dtype) -> tuple[int, dict]:
    """Every variant's device time (and error against the reference) for one [1, K] x [K, N] product."""
    x = torch.randn(1, k, dtype=dtype, device=device)
    copies = 1 if DRY else max(2, L2_FLUSH_BYTES // (n * k))  # int8's bytes; int4 re-reads half as often
    timer = (lambda fn, c: float("nan")) if DRY else device_time_us
    dense = [torch.randn(n, k, dtype=dtype, device=device) / 64 for _ in range(max(1, copies // 2))]
    rows: dict = {"bf16 cublas": {"us": timer(lambda i: torch.nn.functional.linear(x, dense[i % len(dense)]), copies)}}
    if not DRY:
        fp8 = [quantize_fp8(d) for d in dense]
        rows["fp8 scaled_mm"] = {"us": timer(lambda i: fp8_matmul_scaled_mm(x, *fp8[i % len(fp8)]), copies)}
        rows["fp8 activation quant only"] = {"us": timer(lambda i: (x / x.abs().amax()).to(torch.float8_e4m3fn),
                                                         copies)}
        # fp8 weights read by the W8A16 kernel (e4m3 widens to bf16 exactly): no activation quantization.
        for split_k in (None, 4):
            key = "fp8 w8a16 kernel" + ("" if split_k is None else f" split{split_k}")
            try:
                expected = torch.nn.functional.linear(x.float(), fp8[0][0].float()) * fp8[0][1]
                out = call("int8", x, fp8[0], {}, split_k)
                error = ((out.float() - expected).norm() / expected.norm()).item()
                rows[key] = {"us": timer(lambda i, split_k=split_k: call("int8", x, fp8[i % len(fp8)], {}, split_k),
                                         copies), "rel_error": round(error, 5)}
            except Exception as exc:  # noqa: BLE001  the compiler may refuse fp8 loads: a result too
                rows[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        fp8.clear()
        rows |= checkpoint_formats(x, n, k, copies, timer)
    dense.clear()  # frees the memory (the timed lambdas are done with it)
    for fmt in ("int8", "int4"):
        pool = [weights_of(fmt, n, k, device) for _ in range(copies)]
        expected = reference(fmt, x, pool[0])
        for kind, label, options in variants():
            if kind != fmt or (DRY and label not in ("default", "n32-k256", "n32", "gemv n32-g4")):
                continue
            for split_k in (None, 4) if label != "default" else (None,):
                key = f"{kind} {label}" + ("" if split_k is None else f" split{split_k}")
                try:
                    out = call(kind, x, pool[0], options, split_k)
                    error = ((out.float() - expected.float()).norm() / expected.float().norm()).item()
                    us = timer(lambda i, kind=kind, options=options, split_k=split_k, pool=pool:
                               call(kind, x, pool[i], options, split_k), copies)
                    rows[key] = {"us": us, "rel_error": round(error, 5)}
                except Exception as exc:  # noqa: BLE001  a tile shape the compiler refuses is a result too
                    rows[key] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        pool.clear()
    return copies, rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if DRY else "cuda")
    dtype = torch.float32 if DRY else torch.bfloat16
    shapes = {"tiny": (96, 512)} if DRY else SHAPES
    report: dict = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "m": 1, "shapes": {}}
    started = time.perf_counter()
    for name, (n, k) in shapes.items():
        copies, rows = sweep_shape(n, k, device, dtype)
        bf16_us = rows["bf16 cublas"]["us"]
        for row in rows.values():
            if "us" in row and not DRY:
                row["us"] = round(row["us"], 2)
                row["vs_bf16"] = round(bf16_us / row["us"], 2)
        report["shapes"][name] = {"n": n, "k": k, "copies": copies, "rows": rows}
        print(f"{name} ({n}x{k}):")
        for fmt in ("bf16", "fp8", "int8", "int4"):
            ranked = sorted(((r["us"], key) for key, r in rows.items() if key.startswith(fmt) and "us" in r),
                            key=lambda t: t[0])
            for us, key in ranked[:3]:
                print(f"  {key:34} {us:9.2f} us  {rows[key].get('vs_bf16', '')}x bf16  "
                      f"err {rows[key].get('rel_error', '')}")
        failed = [key for key, r in rows.items() if "error" in r]
        if failed:
            print(f"  failed: {failed} ({rows[failed[0]]['error']})")
        args.json.write_text(json.dumps(report, indent=1))
    print(f"sweep took {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
