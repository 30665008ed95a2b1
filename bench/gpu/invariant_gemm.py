"""The batch-invariant GEMMs on a GPU (kernels/invariant_gemm.py, KAON_GPU_BATCH_INVARIANT=1): what they cost
against the default kernels, and whether a row's bits really stay put.

    python bench/gpu/invariant_gemm.py --json gemv.json [--budget 60] [--dry-run]

The report goes under the key "invariant_gemm" of the JSON named (gemv_sweep.py's, when it is there: a lease's
call brings back few files, and this runs in the same stage).

On Llama-3.1-8B's four projection shapes (bf16 activations), at M = 1, 8, 64 and 512 rows, it times:
- dense bf16: cuBLAS (F.linear, the default) against the invariant GEMM;
- each quantized format the engine loads (int4 in groups of 32 with float16 scales and of 128 with float32
  scales, int8 per row, FP8 per row, FP8 in 128 x 128 blocks): its default GPU path at that M (quant_gemv for
  a few rows, then quant_gemm's tiles, torch._scaled_mm or a widened weight through cuBLAS) against its
  invariant path (quant/invariant.py);
each as microseconds, the weight's GB/s, TFLOPS and invariant / default. Each output is first checked
against the float32 reference (gemv_sweep.py's), and timed as gemv_sweep.py times (a CUDA graph over
enough weight copies to overflow L2, median of 5 replays).

Then, per shape and kernel, how many outputs move when a row is computed in a batch of another size: row
prefixes (1, 8, 64 of 512 rows: same place in the tile, other neighbours) and a shifted window (rows 3-66
as a batch of their own: every row at another place in its tile, which Triton's interpreter cannot show on
a CPU). The default kernels are expected to move; the invariant ones must not (0).

`--budget`: seconds after which the remaining shapes are skipped (the JSON says so), so the gemv stage of
bench/gpu/run.sh, which runs this after gemv_sweep.py, stays inside its limit. `--dry-run` (or
KAON_GPU_DRY=1): a tiny shape on the CPU through Triton's interpreter, float32 (the script proven, no timings).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from gemv_sweep import DRY, MAX_ERROR, before, device_time_us, reference, weights_of  # also sets up the interpreter

from kaon_runtime.kernels import invariant_gemm, quant_gemv
from kaon_runtime.quant.fp8 import fp8_matmul_ref, scaled_mm_supported

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = (1, 8, 64, 512)
FORMATS = ("int4", "int4 g128", "int8", "fp8", "fp8_block")
L2_FLUSH_BYTES = 256 << 20


def invariant(fmt: str, x, w):
    if fmt == "dense":
        return invariant_gemm.linear(x, w)
    if fmt.startswith("int4"):
        return invariant_gemm.w4a16_linear(x, *w)
    if fmt == "int8":
        return invariant_gemm.w8a16_linear(x, *w)
    if fmt == "fp8":
        return invariant_gemm.fp8_linear(x, *w)
    return invariant_gemm.fp8_block_linear(x, *w)  # Fp8BlockLinear under the switch


def default(fmt: str, x, w):
    """What the linear runs without the switch at this M: quant_gemv's kernels for a few rows, then before()."""
    if fmt == "dense":
        return torch.nn.functional.linear(x, w)
    gemv_format = "int4" if fmt.startswith("int4") else fmt
    if fmt == "fp8" and not quant_gemv.fits(x, "fp8") and not scaled_mm_supported(x, w[0]):
        return fp8_matmul_ref(x, *w)  # Fp8Linear's path where torch._scaled_mm cannot run
    if quant_gemv.fits(x, gemv_format):
        if fmt.startswith("int4"):
            return quant_gemv.w4a16_gemv(x, *w)
        if fmt == "int8":
            return quant_gemv.w8a16_gemv(x, *w)
        return quant_gemv.fp8_gemv(x, *w) if fmt == "fp8" else quant_gemv.fp8_block_gemv(x, *w)
    return before(fmt, x, w)


def weight_bytes(w) -> int:
    tensors = w if isinstance(w, tuple) else (w,)
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def moved(fn, fmt: str, x, w) -> dict:
    """Outputs that differ from the whole batch's same rows: prefixes, and a shifted window of rows."""
    full = fn(fmt, x, w)
    if full is None:
        return {"error": "not supported here"}
    counts = {f"prefix {m}": int((fn(fmt, x[:m], w) != full[:m]).sum()) for m in ROWS[:-1]}
    window = min(64, x.shape[0] - 3)
    counts["shifted 3"] = int((fn(fmt, x[3:3 + window], w) != full[3:3 + window]).sum())
    return counts


def measure(fmt: str, fn, x, pool: list, timer, copies: int) -> dict:
    try:
        out = fn(fmt, x, pool[0])
        if out is None:
            return {"error": "not supported here"}
        expected = torch.nn.functional.linear(x.float(), pool[0].float()) if fmt == "dense" else \
            reference(fmt, x, pool[0])
        error = ((out.float() - expected).norm() / expected.norm()).item()
        # FP8's default path quantizes x to FP8 too (torch._scaled_mm): a looser bound, as gemv_sweep's
        if not error < (5e-2 if fmt == "fp8" else MAX_ERROR):
            return {"rel_error": error, "error": "wrong result"}
        return {"us": timer(lambda i: fn(fmt, x, pool[i % len(pool)]), copies), "rel_error": round(error, 5)}
    except Exception as exc:  # noqa: BLE001  a failure is a figure too
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}


def with_rates(entry: dict, m: int, n: int, k: int, w) -> dict:
    us = entry.get("us")
    if not us or us != us:  # none, or NaN in the dry run
        return entry
    moved_bytes = weight_bytes(w) + 2 * m * (k + n)
    return entry | {"GB/s": round(moved_bytes / us / 1e3, 1), "TFLOPS": round(2 * m * n * k / us / 1e6, 2)}


def shape_report(n: int, k: int, device, dtype) -> dict:
    copies = 1 if DRY else max(2, L2_FLUSH_BYTES // (n * k))
    timer = (lambda fn, c: float("nan")) if DRY else device_time_us
    rows_x = torch.randn(max(ROWS), k, dtype=dtype, device=device)
    report: dict = {"n": n, "k": k, "copies": copies, "times": {}, "moved": {}}
    for fmt in ("dense",) + FORMATS:
        if fmt == "dense":
            pool = [torch.randn(n, k, dtype=dtype, device=device) / 64 for _ in range(max(1, copies // 2))]
        else:
            pool = [weights_of(fmt, n, k, device, dtype) for _ in range(copies if fmt != "fp8_block" else 2)]
        for m in ROWS:
            x = rows_x[:m]
            times = {kind: with_rates(measure(fmt, fn, x, pool, timer, len(pool)), m, n, k, pool[0])
                     for kind, fn in (("default", default), ("invariant", invariant))}
            base, new = times["default"].get("us"), times["invariant"].get("us")
            if base and new and base == base:
                times["invariant / default"] = round(new / base, 2)
            report["times"][f"{fmt} m{m}"] = times
        report["moved"][fmt] = {kind: moved(fn, fmt, rows_x, pool[0])
                                for kind, fn in (("default", default), ("invariant", invariant))}
        pool.clear()
    return report


def summary(shapes: dict) -> list[str]:
    lines = []
    for name, shape in shapes.items():
        if "times" not in shape:
            continue
        for key, times in shape["times"].items():
            parts = []
            for kind in ("default", "invariant"):
                t = times[kind]
                parts.append(f"{kind} {t['us']:.1f} us {t.get('GB/s', '-')} GB/s {t.get('TFLOPS', '-')} TF"
                             if "us" in t and t["us"] == t["us"] else f"{kind} {t.get('error', 'untimed')}")
            lines.append(f"{name} {key}: " + "; ".join(parts) + f"; ratio {times.get('invariant / default', '-')}")
        for fmt, kinds in shape["moved"].items():
            counted = "; ".join(f"{kind} {counts}" for kind, counts in kinds.items())
            lines.append(f"{name} {fmt} outputs moved: {counted}")
    return lines


def main() -> int:
    global ROWS
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--budget", type=float, default=60.0, help="seconds; the shapes left are skipped")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu" if DRY else "cuda")
    dtype = torch.float32 if DRY else torch.bfloat16  # the interpreter multiplies bf16 tl.dot operands wrongly
    shapes = {"tiny": (40, 256)} if DRY else SHAPES
    if DRY:
        ROWS = (1, 8, 40)
    report: dict = {"device": "cpu (dry run)" if DRY else torch.cuda.get_device_name(), "torch": torch.__version__,
                    "rows": ROWS, "shapes": {}}
    started = time.perf_counter()

    def write() -> None:
        whole = json.loads(args.json.read_text()) if args.json.exists() else {}
        args.json.write_text(json.dumps(whole | {"invariant_gemm": report}, indent=1))

    for name, (n, k) in shapes.items():
        if time.perf_counter() - started > args.budget:
            report["shapes"][name] = {"skipped": f"past the {args.budget:.0f} s budget"}
            continue
        report["shapes"][name] = shape_report(n, k, device, dtype)
        print(f"{name} ({n}x{k}) done at {time.perf_counter() - started:.0f}s", flush=True)
        write()
    report["summary"] = summary(report["shapes"])
    write()
    print("\n".join(report["summary"]))
    print(f"invariant GEMM bench took {time.perf_counter() - started:.0f}s")
    invariant_moved = [(name, fmt, counts) for name, shape in report["shapes"].items() for fmt, kinds in
                       shape.get("moved", {}).items() for counts in [kinds["invariant"]] if any(
                           v for v in counts.values() if isinstance(v, int))]
    if invariant_moved:
        print(f"invariant kernels moved outputs: {invariant_moved}")
    return 0  # figures, not a gate: a moved row is reported (the JSON and the line above), the stage goes on


if __name__ == "__main__":
    sys.exit(main())
