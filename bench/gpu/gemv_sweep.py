"""Decode's quantized matrix products on a GPU: each format's kernels against cuBLAS bf16, per tile shape.

    python bench/gpu/gemv_sweep.py --json gemv.json [--dry-run]

On Llama-3.1-8B's four projection shapes, at M = 1, 2 and 4 rows (decode's batches) and 8 and 16 (where
quant_gemm's tl.dot kernels take over), it times:
- bf16 F.linear (cuBLAS): the baseline every ratio is against;
- the kernels the engine ran before kernels/quant_gemv.py: quant_gemm's W4A16 / W8A16 tl.dot kernels,
  and torch._scaled_mm for FP8 (with its per-row activation quantization);
- quant_gemv's kernels over candidate tiles, for each format the engine loads: int4 in groups of 32
  with float16 scales (kaon's own and GGUF Q4_1's), int4 in groups of 128 with float32 scales (GPTQ and
  AWQ as loaded), int8 per row, FP8 per row, FP8 in 128 x 128 blocks (DeepSeek, Qwen3).
Every variant's output is first checked against the torch reference: one that errs or misses is
reported and never chosen. The choice per format, the tile with the least time summed over the four
shapes at M = 1, goes to the JSON's "tiles"; decode_roofline.py --gemv-tiles runs the engine with it.

Each timing is the device time of one call inside a captured CUDA graph that runs the call over enough
weight copies to overflow the L2 cache (weights come from memory, as in decode), median of 5 replays.
Every variant is compiled first by a pool of processes (Triton's cache is shared), so the timing loop
only loads kernels.

`--dry-run`: tiny shapes on the CPU through Triton's interpreter (the script proven, no timings).

Over 300 lines for a stated reason: one device call must build, check, time and choose every variant and
report it (a lease gives one prepared command), so the weights per format, the references, the timing in
graphs and the choice live together.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv or os.environ.get("KAON_GPU_DRY") == "1"
if DRY:
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "runtime"))

import triton  # noqa: E402

from kaon_runtime.kernels import quant_gemm, quant_gemv  # noqa: E402
from kaon_runtime.kernels.quant_gemm_ref import w4a16_matmul_ref, w8a16_matmul_ref  # noqa: E402
from kaon_runtime.quant.fp8 import fp8_matmul_scaled_mm, quantize_fp8, scaled_mm_supported  # noqa: E402
from kaon_runtime.quant.fp8_block import dequantize_fp8_blocks  # noqa: E402

# Llama-3.1-8B: q|k|v, o, gate|up, down as (N, K).
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GEMV_ROWS = (1, 2, 4)
GEMM_ROWS = (8, 16)
L2_FLUSH_BYTES = 256 << 20
MAX_ERROR = 2e-2  # bf16 outputs against float32 references: a kernel that is right lands near 2e-3
MAX_ERROR_W8A8 = 5e-2  # torch._scaled_mm quantizes x to FP8 too: about 2.6e-2 from the weight-only reference
Tile = quant_gemv.Tile

# label -> tile. Rows per thread and bytes per row per step (subs x vec) set the work per thread and the
# loads in flight; "x/thread": x loaded by each thread per weight row; "ri": the rows inner (a thread
# holds all the program's rows of its runs), "x/once": x's run loaded and widened once per thread for
# them; else x once per step through shared memory; "fold": the group / block scales applied per run
# of products, not per weight; "pf": the next step's bytes loaded before this step's widening; "v16":
# 16-byte runs. The compiler's count of each one's loop (SASS instructions per weight, Triton 3.6,
# sm_90a, M = 1): bench/gpu/README.md.
CANDIDATES = {
    "n2-s128-w4 x/thread": Tile(2, 128, x_shared=False),  # int4's default: 7.1 instructions per weight
    "n4-s128-w4": Tile(4, 128),  # int8's, FP8's and the FP8 blocks' default: 5.9, 5.1, 6.9
    "n8-s128-w4 ri x/once fold": Tile(8, 128, rows_inner=True, x_once=True, fold=True),
    "n4-s128-w4 ri x/once fold": Tile(4, 128, rows_inner=True, x_once=True, fold=True),
    "n8-s64-w2 ri x/once fold": Tile(8, 64, 2, rows_inner=True, x_once=True, fold=True),
    "n4-s256-w8 ri x/once fold": Tile(4, 256, 8, rows_inner=True, x_once=True, fold=True),
    "n8-s128-w4 ri x/once": Tile(8, 128, rows_inner=True, x_once=True),
    "n8-s128-w4 ri x/once fold pf": Tile(8, 128, rows_inner=True, x_once=True, fold=True, prefetch=True),
    "n8-s128-w4 ri fold": Tile(8, 128, rows_inner=True, fold=True),
    "n8-s64-w4 ri v16 x/once fold": Tile(8, 64, rows_inner=True, vec=16, x_once=True, fold=True),
    "n2-s64-w2 x/thread": Tile(2, 64, 2, x_shared=False),  # round two's best on gate|up (int4, FP8)
}
_NEW = ["n8-s128-w4 ri x/once fold", "n4-s128-w4 ri x/once fold", "n8-s64-w2 ri x/once fold",
        "n4-s256-w8 ri x/once fold", "n8-s128-w4 ri x/once", "n8-s128-w4 ri x/once fold pf"]
# Per format, the candidates tried, the first the runtime's default (quant_gemv.TILES); at M = 2 and 4
# only the first three. Round two's other tiles, dropped, lost to the defaults on the four shapes' total at
# M = 1 (history/gpu_round_two.md); n2-s64-w2 x/thread, the best on gate|up, stays for int4 and FP8.
# int4 skips the 16-byte runs and x shared (layout changes through shared memory in its loop).
FORMATS = {"int4": ["n2-s128-w4 x/thread"] + _NEW + ["n2-s64-w2 x/thread", "n4-s128-w4"],
           "int4 g128": ["n2-s128-w4 x/thread"] + _NEW,
           "int8": ["n4-s128-w4"] + _NEW + ["n8-s128-w4 ri fold", "n2-s128-w4 x/thread"],
           "fp8": ["n4-s128-w4"] + _NEW + ["n8-s128-w4 ri fold", "n8-s64-w4 ri v16 x/once fold",
                                           "n2-s64-w2 x/thread"],
           "fp8_block": ["n4-s128-w4"] + _NEW + ["n8-s128-w4 ri fold"]}
TILE_FORMAT = {"int4": "int4", "int4 g128": "int4", "int8": "int8", "fp8": "fp8", "fp8_block": "fp8_block"}


def weights_of(fmt: str, n: int, k: int, device, dtype) -> tuple:
    """Random weights in the format's layout (never zeros: they can time faster than real data)."""
    if fmt.startswith("int4"):
        group = 128 if fmt == "int4 g128" else 32
        scale_dtype = torch.float32 if fmt == "int4 g128" else torch.float16
        return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device),
                (torch.rand(n, k // group, device=device) / 50).to(scale_dtype),
                (-torch.rand(n, k // group, device=device) / 7).to(scale_dtype), group)
    if fmt == "int8":
        return torch.randint(-127, 128, (n, k), dtype=torch.int8, device=device), torch.rand(n, device=device) / 100
    qweight = quantize_fp8(torch.randn(n, k, device=device, dtype=dtype) / 64)[0]
    if fmt == "fp8":
        return qweight, torch.rand(n, device=device) / 100
    return qweight, torch.rand(triton.cdiv(n, 128), triton.cdiv(k, 128), device=device) / 100, (128, 128)


def gemv(fmt: str, x, w):
    if fmt.startswith("int4"):
        return quant_gemv.w4a16_gemv(x, *w)
    if fmt == "int8":
        return quant_gemv.w8a16_gemv(x, *w)
    return quant_gemv.fp8_gemv(x, *w) if fmt == "fp8" else quant_gemv.fp8_block_gemv(x, *w)


def before(fmt: str, x, w):
    """What the engine ran for this format before quant_gemv (and still runs above MAX_ROWS rows)."""
    if fmt.startswith("int4"):
        return quant_gemm.w4a16_matmul(x, *w)
    if fmt == "int8":
        return quant_gemm.w8a16_matmul(x, *w)
    if fmt == "fp8":
        return fp8_matmul_scaled_mm(x, *w) if scaled_mm_supported(x, w[0]) else None
    return torch.nn.functional.linear(x, dequantize_fp8_blocks(*w).to(x.dtype))  # Fp8BlockLinear's GPU path


def reference(fmt: str, x, w) -> torch.Tensor:
    if fmt.startswith("int4"):
        return w4a16_matmul_ref(x.float(), *w)
    if fmt == "int8":
        return w8a16_matmul_ref(x.float(), *w)
    if fmt == "fp8":
        return torch.nn.functional.linear(x.float(), w[0].float()) * w[1]
    return torch.nn.functional.linear(x.float(), dequantize_fp8_blocks(*w))


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


def candidates(fmt: str) -> list[tuple[str, Tile]]:
    return [(label, CANDIDATES[label]) for label in FORMATS[fmt]]


def compile_one(task: tuple) -> str:
    """A worker: one variant called once on a real shape, which leaves the compiled kernel in Triton's cache."""
    fmt, tile, rows, (n, k) = task
    quant_gemv.configure({TILE_FORMAT[fmt]: tile})
    dtype = torch.bfloat16
    try:
        gemv(fmt, torch.randn(rows, k, device="cuda", dtype=dtype), weights_of(fmt, n, k, "cuda", dtype))
        torch.cuda.synchronize()
        return ""
    except Exception as exc:  # noqa: BLE001  a tile the compiler refuses is a result, reported by the timing loop
        return f"{fmt} {tile}: {type(exc).__name__}: {str(exc)[:200]}"


def precompile() -> None:
    """Compile every variant in parallel; the shapes share their specialization (all divisible by 16)."""
    tasks = [(fmt, tile, rows, SHAPES["o"]) for fmt in FORMATS for i, (_, tile) in enumerate(candidates(fmt))
             for rows in (GEMV_ROWS if i < 3 else GEMV_ROWS[:1])]  # the rows sweep_shape times
    workers = max(1, min(len(tasks), (os.cpu_count() or 2) - 2))
    started = time.perf_counter()
    with ProcessPoolExecutor(max_workers=workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        failures = [f for f in pool.map(compile_one, tasks) if f]
    print(f"compiled {len(tasks)} variants in {time.perf_counter() - started:.0f}s with {workers} processes"
          + (f"; {len(failures)} failed, first: {failures[0]}" if failures else ""), flush=True)


def timed(fmt: str, fn, x, pool: list, expected: torch.Tensor, timer, copies: int,
          max_error: float = MAX_ERROR) -> dict:
    """One variant: its error against the reference, then its time; failures are figures too."""
    try:
        out = fn(fmt, x, pool[0])
        if out is None:
            return {"error": "not supported here"}
        error = ((out.float() - expected).norm() / expected.norm()).item()
        if not error < max_error:
            return {"rel_error": error, "error": "wrong result"}
        return {"us": timer(lambda i: fn(fmt, x, pool[i % len(pool)]), copies), "rel_error": round(error, 5)}
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def sweep_shape(n: int, k: int, device, dtype) -> dict:
    """Every variant's time (and error) for one [M, K] x [K, N] product, per M."""
    copies = 1 if DRY else max(2, L2_FLUSH_BYTES // (n * k))
    timer = (lambda fn, c: float("nan")) if DRY else device_time_us
    rows: dict = {}
    dense = [torch.randn(n, k, dtype=dtype, device=device) / 64 for _ in range(max(1, copies // 2))]
    for m in GEMV_ROWS + GEMM_ROWS:
        x = torch.randn(m, k, dtype=dtype, device=device)
        rows[f"bf16 cublas m{m}"] = {"us": timer(lambda i, x=x: torch.nn.functional.linear(x, dense[i % len(dense)]),
                                                 copies)}
    dense.clear()
    for fmt in FORMATS:
        pool = [weights_of(fmt, n, k, device, dtype) for _ in range(copies if fmt != "fp8_block" else 2)]
        for m in GEMV_ROWS + GEMM_ROWS:
            x = torch.randn(m, k, dtype=dtype, device=device)
            expected = reference(fmt, x, pool[0])
            if fmt != "fp8_block" or m == 1:  # the blocks' old GPU path widens the whole weight: once is enough
                rows[f"{fmt} before m{m}"] = timed(fmt, before, x, pool, expected, timer, copies,
                                                   MAX_ERROR_W8A8 if fmt == "fp8" else MAX_ERROR)
            if m not in GEMV_ROWS:
                continue
            # Every candidate at one row (the dry run too: each tile's real shape checked in the
            # interpreter); the first three at more (the dry run: two).
            tried = candidates(fmt) if m == 1 else candidates(fmt)[:2 if DRY else 3]
            for label, tile in tried:
                quant_gemv.configure({TILE_FORMAT[fmt]: tile})
                rows[f"{fmt} gemv {label} m{m}"] = timed(fmt, gemv, x, pool, expected, timer, copies) | \
                    {"tile": dataclasses.asdict(tile)}
        pool.clear()
    return {"n": n, "k": k, "copies": copies, "rows": rows}


def choose(shapes: dict) -> dict:
    """Per format, the tile with the least time summed over the shapes at M = 1 (only tiles right on all)."""
    tiles = {}
    for fmt in FORMATS:
        totals = {}
        for label, _ in candidates(fmt):
            times = [s["rows"].get(f"{fmt} gemv {label} m1", {}).get("us") for s in shapes.values()]
            if all(t is not None and t == t for t in times):  # every shape timed (NaN in the dry run)
                totals[label] = sum(times)
        if totals:
            best = min(totals, key=totals.get)
            tiles.setdefault(TILE_FORMAT[fmt], CANDIDATES[best])  # int4: kaon's own groups of 32 decide
            print(f"{fmt}: fastest tile {best} ({totals[best]:.1f} us over the four shapes)")
    return {fmt: dataclasses.asdict(tile) for fmt, tile in tiles.items()}


def summary(shapes: dict) -> list[str]:
    """Totals over the four shapes per M: cuBLAS bf16, each format's old kernel and its best gemv tile."""
    def total(key):
        times = [s["rows"].get(key, {}).get("us") for s in shapes.values()]
        return sum(times) if all(t is not None and t == t for t in times) else None

    lines = [f"{'format':10} {'M':>3} {'bf16 us':>9} {'before us':>10} {'best gemv us':>13} {'tile':22} "
             f"{'before/bf16':>11} {'gemv/bf16':>9}"]
    for fmt in FORMATS:
        for m in GEMV_ROWS + GEMM_ROWS:
            bf16, old = total(f"bf16 cublas m{m}"), total(f"{fmt} before m{m}")
            best = min(((total(f"{fmt} gemv {label} m{m}"), label) for label, _ in candidates(fmt)
                        if total(f"{fmt} gemv {label} m{m}") is not None), default=(None, "-"))
            lines.append(f"{fmt:10} {m:>3} {_us(bf16):>9} {_us(old):>10} {_us(best[0]):>13} {best[1]:22} "
                         f"{_ratio(bf16, old):>11} {_ratio(bf16, best[0]):>9}")
    return lines


def _us(t: float | None) -> str:
    return f"{t:.1f}" if t else "-"


def _ratio(bf16: float | None, t: float | None) -> str:
    return f"{bf16 / t:.2f}x" if t and bf16 else "-"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if DRY else "cuda")
    dtype = torch.float32 if DRY else torch.bfloat16
    shapes = {"tiny": (20, 512)} if DRY else SHAPES
    report: dict = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "triton": triton.__version__, "shapes": {}}
    started = time.perf_counter()
    if not DRY:
        precompile()
    for name, (n, k) in shapes.items():
        report["shapes"][name] = sweep_shape(n, k, device, dtype)
        failed = {key: r["error"] for key, r in report["shapes"][name]["rows"].items() if "error" in r}
        print(f"{name} ({n}x{k}) done at {time.perf_counter() - started:.0f}s"
              + (f"; failed: {len(failed)}, e.g. {next(iter(failed.items()))}" if failed else ""), flush=True)
        args.json.write_text(json.dumps(report, indent=1))
    report["tiles"] = choose(report["shapes"])
    report["summary"] = summary(report["shapes"])
    args.json.write_text(json.dumps(report, indent=1))
    print("\n".join(report["summary"]))
    print(f"sweep took {time.perf_counter() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
