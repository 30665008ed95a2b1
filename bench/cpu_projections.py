"""The narrow projections alone: one int8 activation pass per block against two (issue 49 §2).

    python bench/cpu_projections.py [--rows 1 16 64] [--threads 1] [--repeats 9]
                                    [--baseline-source OLD_cpu_decode.c] [--layers 30]

KAON_CPU_ACTIVATIONS=int8x2 (two int8 passes per activation block: the block, then its rounding
remainder) is what makes int8/int4 prompt rows precise enough for the invariant C step; its price
is the second pass's integer dot products. This times the four projections of one SmolLM2-135M
layer (q|k|v 960 x 576, gate|up 3072 x 576, o 576 x 576, down 576 x 1536; random weights in kaon's
int4 = Q4_1 and int8 layouts) through kernels/cpu_decode.c's kaon_linear, one pass and two
alternated in one process, and prints the median of each and their ratio per row count: 1 is
batch-1 decode, 16 a batched decode step, 64 a prefill chunk's share. The weights stay in cache
(the same layer over and over), so batch 1 here is compute, not the memory-bound step the engine
runs; bench/cpu_decode.py --activations measures the engine. --layers 30 times
30 distinct copies (the whole model's projections, ~106 MB in int8, more than any core's L2): each pass
streams them from L3 or memory as batch-1 decode does, the regime where the weights' prefetch counts.
--baseline-source times another version of the C file beside this one
(`git show <rev>:runtime/kaon_runtime/kernels/cpu_decode.c`),
its one pass the reference for the "vs baseline" column: what the default decode cost before.
Two passes are timed twice where the CPU has AMX-INT8 or AVX-512 VNNI: the default (AMX tiles from 4
rows on Intel, the half-register kernels at one row) and the 512-bit pair kernels at every row count
(kaon_set_amx(0) and kaon_set_halves(0): this machine's path before them); the bits are the same.
Times are the process's CPU time (one thread), so other work on a shared machine slows both sides
alike rather than whichever it preempts.
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))

import torch  # noqa: E402

from kaon_runtime.kernels import cpu_decode  # noqa: E402
from kaon_runtime.quant.int4 import quantize_int4  # noqa: E402
from kaon_runtime.quant.int8 import quantize_int8  # noqa: E402

LAYER = [(960, 576), (3072, 576), (576, 576), (576, 1536)]  # SmolLM2-135M: q|k|v, gate|up, o, down


def library(source: Path) -> ctypes.CDLL:
    compiler = cpu_decode.compiler()
    if compiler is None:
        raise SystemExit(cpu_decode.NO_COMPILER)
    saved = cpu_decode.SOURCE
    cpu_decode.SOURCE = source
    try:
        path = cpu_decode.build(compiler)
    finally:
        cpu_decode.SOURCE = saved
    # only what this bench calls (cpu_decode.load declares every function, which an older source may lack)
    lib = ctypes.CDLL(str(path))
    lib.kaon_linear_workspace.restype = ctypes.c_size_t
    lib.kaon_linear_workspace.argtypes = [ctypes.c_int, ctypes.c_int]
    for name in ("kaon_set_amx", "kaon_set_halves"):  # an older source may lack them
        if hasattr(lib, name):
            getattr(lib, name).restype = ctypes.c_int
            getattr(lib, name).argtypes = [ctypes.c_int]
    lib.kaon_linear.restype = None
    lib.kaon_linear.argtypes = [ctypes.POINTER(cpu_decode.Linear), ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int]
    return lib


def layer(kind: str, layers: int = 1) -> list[cpu_decode.LinearWeights]:
    torch.manual_seed(0)
    out = []
    for n, k in LAYER * layers:
        w = torch.randn(n, k) * 0.05
        if kind == "int4":
            q4 = quantize_int4(w, 32)
            out.append(cpu_decode.LinearWeights.q4_1(q4.packed, q4.scales, q4.mins))
        else:
            out.append(cpu_decode.LinearWeights.int8(*quantize_int8(w)))
    return out


def time_layer(lib, weights, passes: int, rows: int, threads: int, iters: int, amx: bool = True) -> float:
    """CPU microseconds for the layer's four projections at `rows` rows (amx: two passes may take AMX tiles and,
    at one row, the half-register kernels; off: the pair kernels)."""
    if hasattr(lib, "kaon_set_amx"):
        lib.kaon_set_amx(int(amx))
    if hasattr(lib, "kaon_set_halves"):
        lib.kaon_set_halves(int(amx))
    calls = []
    for lw in weights:
        k, n = lw.struct.k, lw.struct.n
        x = torch.randn(rows, k)
        calls.append((lw, x, torch.empty(rows, n), torch.empty(lib.kaon_linear_workspace(k, rows), dtype=torch.uint8)))
    for lw, *_ in calls:
        lw.struct.act_passes = passes
    start = time.process_time()
    for _ in range(iters):
        for lw, x, y, work in calls:
            lib.kaon_linear(ctypes.byref(lw.struct), rows, x.data_ptr(), y.data_ptr(), work.data_ptr(), threads)
    return (time.process_time() - start) / iters * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline-source", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=1,
                        help="distinct copies of the layer timed in turn (30: the whole model's ~106 MB of int8 "
                             "weights, streamed from memory each pass as batch-1 decode does; 1: in cache, compute)")
    args = parser.parse_args()
    libs = {"this": library(cpu_decode.SOURCE)}
    if args.baseline_source:
        libs["baseline"] = library(args.baseline_source)
    amx = bool(libs["this"].kaon_set_amx(1)) or bool(libs["this"].kaon_set_halves(1))
    print(f"torch {torch.__version__}, {args.threads} thread(s), the four projections of {args.layers} SmolLM2-135M "
          f"layer(s), "
          f"median of {args.repeats} alternations (CPU us); AMX tiles / batch-1 halves: "
          f"{'yes' if amx else 'no (pairs only)'}")
    header = f"{'':14} {'one pass':>9} {'two':>9} {'two/one':>8}"
    if amx:
        header += f" {'two, pairs':>11} {'pairs/one':>10}"
    if "baseline" in libs:
        header += f" {'baseline one':>13} {'two':>9} {'this two / baseline one':>24}"
    print(header)
    for kind in ("int4", "int8"):
        weights = layer(kind, args.layers)
        for rows in args.rows:
            iters = max(3, 400 // rows // args.layers)
            arms = [(lib, p, True) for lib in libs for p in (1, 2)] + ([("this", 2, False)] if amx else [])
            times: dict[tuple[str, int, bool], list[float]] = {arm: [] for arm in arms}
            for _ in range(args.repeats):
                for (name, passes, tiles), found in times.items():
                    found.append(time_layer(libs[name], weights, passes, rows, args.threads, iters, tiles))
            med = {(name, passes): statistics.median(v) for (name, passes, tiles), v in times.items() if tiles}
            line = (f"{kind + f' {rows:3d} rows':14} {med['this', 1]:9.1f} {med['this', 2]:9.1f} "
                    f"{med['this', 2] / med['this', 1]:7.2f}x")
            if amx:
                pairs = statistics.median(times["this", 2, False])
                line += f" {pairs:11.1f} {pairs / med['this', 1]:9.2f}x"
            if "baseline" in libs:
                line += (f" {med['baseline', 1]:13.1f} {med['baseline', 2]:9.1f} "
                         f"{med['this', 2] / med['baseline', 1]:23.2f}x")
            print(line, flush=True)


if __name__ == "__main__":
    main()
