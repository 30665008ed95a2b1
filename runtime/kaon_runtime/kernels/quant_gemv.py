"""Decode's quantized matrix-vector products on a GPU: a few rows of x (1-4) against a whole weight.

Why not quant_gemm's kernels at batch 1: tl.dot wants 16 rows, so they pad x to 16 and widen every
weight into a matrix-multiply operand; the first GPU run measured int4 at 0.40x and FP8
(torch._scaled_mm, which also quantizes x) at 0.68x cuBLAS bf16 on Llama-3.1-8B's projections
(bench/RESULTS.md, "GPU first light"), although they read a third and half of the bytes. Batch-1
decode is bound by memory: the kernel must stream the weights at the memory's pace and spend only a
few instructions on each weight, or the instructions become the bound. Here:

- a program owns BLOCK_N weight rows and walks all of K in steps of SUBS runs of VEC bytes per row;
  each thread loads whole runs (8 bytes: int4's 16 weights, or 8 int8 / FP8 weights; or 16);
- int4 and int8 are widened to float32 without an int-to-float conversion instruction (a quarter of
  the rate of a multiply-add on Hopper): the integer goes into a float's mantissa, four bytes per
  byte-permute instruction (inline PTX; plain integer operations in the interpreter, same values);
  FP8 through Triton's conversion (hardware on sm_90);
- group and block scales (and int4's mins) are applied to the widened weights, then multiplied by x
  into an accumulator of the tile's own shape: one fused multiply-add per weight, no sums inside the
  loop. Sums over K happen once, after it: so K needs no split into separate programs, no
  partial-sum buffer and no second launch, and a row gives the same bits alone as beside up to three
  others (above a format's MAX_ROWS another kernel takes over, with its own rounding).

Tile options the sweep weighs against that (bench/gpu/README.md has the compiler's counts): the rows
inner (each thread holds all the program's rows of its runs, so x's run is loaded and widened once for
them: `rows_inner`, `x_once`); the scales folded out of the inner loop (`fold`: a run's products
summed in the thread, then its group or block scale applied once; int4's min through x's run sum, so
still no sums across threads in the loop); the next step's bytes loaded before this step is widened
(`prefetch`). A row's sums never depend on the other rows in any of them.

Over 300 lines: one kernel and its jit helpers, whose options must stay in step (the tests and the
sweep drive them all through this one launcher).

Formats (layouts as in quant_gemm_ref.py and quant/fp8_block.py):
- int4: packed uint8 [N, K / 2], scales and mins [N, K / group] (float16 from kaon and GGUF, float32
  from GPTQ / AWQ), group a power of two >= 32: w = q * scale + min.
- int8 and FP8 (e4m3): [N, K], one scale per row: w = q * scale.
- FP8 blocks: [N, K], scales [ceil(N / rows), ceil(K / cols)] (DeepSeek's and Qwen3's 128 x 128).

Tile shapes come from a table measured on an H200 by bench/gpu/gemv_sweep.py; `configure` replaces it
(the sweep does, to time its candidates).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Per format, the most rows of x these kernels take; more go to quant_gemm's tl.dot kernels (int4, int8) or
# torch._scaled_mm (FP8). From the first sweep (H200, 2026-11-30, bench/RESULTS.md): each added row costs
# about as much as a whole bf16 pass over the weight, so int8 beats its tl.dot kernel at one row only,
# int4 and FP8 blocks (whose other paths are far slower) up to four.
MAX_ROWS: dict[str, int] = {"int4": 4, "int8": 1, "fp8": 2, "fp8_block": 4}
ROWS_LIMIT = 4  # the kernel's unrolled accumulators

_INT4, _INT8, _FP8 = 0, 1, 2
_ROW_SCALE, _GROUP_SCALE, _BLOCK_SCALE = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Tile:
    block_n: int  # weight rows per program
    subs: int  # runs of `vec` bytes per row per step
    warps: int = 4
    x_shared: bool = True  # x loaded once per step and moved into the tile's layout (else by every thread)
    asm: bool = True  # bytes widened by inline PTX (GPU only), else by plain integer operations
    vec: int = 8  # contiguous weight bytes per thread and run (8: x's bfloat16 run is one 16-byte load)
    # x loaded with a weight-row axis of 1 in the tile's own shape (overrides x_shared): with rows_inner,
    # each thread widens its x once per step for all the program's rows, with no change of layout
    # (without, Triton 3.6 still moves it through shared memory: bench/gpu/README.md).
    x_once: bool = False
    # Products summed per run inside the thread, then the run's group or block scale applied once per
    # run (int4: d * sum (128 + q) x + (m - 128 d) * sum x): one FMA per weight instead of two (int4)
    # or an FMA and a multiply (FP8 blocks). No effect on per-row scales (applied after the loop anyway).
    fold: bool = False
    prefetch: bool = False  # the next step's weight bytes and scales loaded before this step's widening
    # The tile laid out [SUBS, BLOCK_N, VEC]: each thread holds all the program's weight rows of its runs
    # and widens x's run once for them (else Triton spreads threads over the rows too: _gemv_kernel).
    rows_inner: bool = False


# Per format: the tile with the least time over Llama-3.1-8B's four projections at one row, measured by
# bench/gpu/gemv_sweep.py on an H200 (2026-11-30, Triton 3.6; bench/RESULTS.md).
TILES: dict[str, Tile] = {
    "int4": Tile(block_n=2, subs=128, x_shared=False),
    "int8": Tile(block_n=4, subs=128),
    "fp8": Tile(block_n=4, subs=128),
    "fp8_block": Tile(block_n=4, subs=128),
}


def configure(tiles: dict[str, Tile]) -> None:
    """Replace entries of the tile table (bench/gpu/gemv_sweep.py's measured choice)."""
    TILES.update(tiles)


@triton.jit
def _exact_float(v):
    """int32 0 <= v < 2^23 -> float32, exactly: v placed in the mantissa of 2^23, then 2^23 taken off."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _nibble_plus_128(v):
    """int32 0 <= v < 16 -> float32 128 + v: v in the mantissa bits of 128.0 that count ones (the scale
    step takes the 128 off: (128 + q) d + (m - 128 d) = q d + m, so no subtraction per weight)."""
    return ((v << 16) | 0x43000000).to(tl.float32, bitcast=True)


# Four bytes of a register, each moved into a float32's bits by one byte permute (PTX prmt: result byte
# i = byte (selector nibble i) of {t: 0-3, m: 4-7}). Triton's plain path extracts, masks and ORs each
# byte on its own: about twice the instructions.
_PERMUTE_4 = """{
.reg .b32 m, t;
mov.b32 m, MAGIC;
MASK
prmt.b32 $0, t, m, S0;
prmt.b32 $1, t, m, S1;
prmt.b32 $2, t, m, S2;
prmt.b32 $3, t, m, S3;
}"""


def _permute_asm(mask: str, magic: int, selectors: list[int]) -> tl.constexpr:
    asm = _PERMUTE_4.replace("MASK", mask).replace("MAGIC", hex(magic))
    for i, selector in enumerate(selectors):
        asm = asm.replace(f"S{i}", hex(selector))
    return tl.constexpr(asm)


# Nibbles as 128 + q: byte k of t into byte 2 of 0x43000000 (result bytes [m0, m1, t_k, m3]).
_ASM_LOW_NIBBLES = _permute_asm("and.b32 t, $4, 0x0F0F0F0F;", 0x43000000, [0x7054 + k * 0x100 for k in range(4)])
_ASM_HIGH_NIBBLES = _permute_asm("shr.b32 t, $4, 4; and.b32 t, t, 0x0F0F0F0F;", 0x43000000,
                                 [0x7054 + k * 0x100 for k in range(4)])
# int8 as q + 128 (the sign bit flipped) into byte 0 of 2^23 (result bytes [t_k, m1, m2, m3]).
_ASM_SIGNED_BYTES = _permute_asm("xor.b32 t, $4, 0x80808080;", 0x4B000000, [0x7540 + k for k in range(4)])


@triton.jit
def _widen(w, KIND: tl.constexpr, ASM: tl.constexpr):
    """Weight bytes as float32: int4 as (128 + low nibble, 128 + high nibble), int8 and FP8 exactly."""
    if KIND == 0:
        if ASM:  # four bytes per asm instance (GPU only)
            lo = tl.inline_asm_elementwise(_ASM_LOW_NIBBLES, "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True,
                                           pack=4)
            hi = tl.inline_asm_elementwise(_ASM_HIGH_NIBBLES, "=r,=r,=r,=r,r", [w], dtype=tl.int32, is_pure=True,
                                           pack=4)
            return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)
        q = w.to(tl.int32) & 0xFF
        return _nibble_plus_128(q & 0xF), _nibble_plus_128(q >> 4)
    if KIND == 1:
        if ASM:
            bits = tl.inline_asm_elementwise(_ASM_SIGNED_BYTES, "=r,=r,=r,=r,r", [w], dtype=tl.int32,
                                             is_pure=True, pack=4)
            v = bits.to(tl.float32, bitcast=True) - (8388608.0 + 128.0)
        else:
            v = _exact_float((w.to(tl.int32) + 128) & 0xFF) - 128.0
        return v, v
    v = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)  # e4m3 read as bytes: a masked byte is 0, not NaN
    return v, v


@triton.jit
def _rows3(t, INNER: tl.constexpr):
    """[BLOCK_N] -> the tile's three dims: [BLOCK_N, 1, 1], or [1, BLOCK_N, 1] with the rows inner."""
    if INNER:  # noqa: SIM108  statements, as compiled and counted for sm_90a with Triton 3.6
        r = t[None, :, None]
    else:
        r = t[:, None, None]
    return r


@triton.jit
def _runs3(t, INNER: tl.constexpr):
    """[SUBS, VEC] -> the tile's three dims: [1, SUBS, VEC], or [SUBS, 1, VEC] with the rows inner."""
    if INNER:  # noqa: SIM108  as above
        r = t[:, None, :]
    else:
        r = t[None]
    return r


@triton.jit
def _grid2(rows, runs, INNER: tl.constexpr):
    """[BLOCK_N] and [SUBS] -> both in the runs' layout: [BLOCK_N, SUBS], or [SUBS, BLOCK_N] rows inner."""
    if INNER:
        a = rows[None, :]
        b = runs[:, None]
    else:
        a = rows[:, None]
        b = runs[None, :]
    return a, b


@triton.jit
def _load_x(x_ptr, stride_xm, M, k, in_row, zero_n, ROW: tl.constexpr, X_MODE: tl.constexpr, INNER: tl.constexpr):
    """Row ROW of x at the step's columns k [SUBS, VEC], as float32, shaped to broadcast over the weight
    tile. X_MODE 0: loaded once as [SUBS, VEC] and broadcast (Triton moves it into the tile's layout
    through shared memory where the layouts differ); 1: loaded in the tile's whole shape, each thread its
    own copy per weight row, from L1; 2: loaded with a weight-row axis of 1 (each thread its own copy)."""
    ok = in_row & (k * 0 + ROW < M)
    x_row = x_ptr + ROW * stride_xm
    if X_MODE == 0:
        x = _runs3(tl.load(x_row + k, mask=ok, other=0.0).to(tl.float32), INNER)
    elif X_MODE == 1:
        x = tl.load(x_row + zero_n + _runs3(k, INNER), mask=_runs3(ok, INNER), other=0.0).to(tl.float32)
    else:
        x = tl.load(x_row + _runs3(k, INNER), mask=_runs3(ok, INNER), other=0.0).to(tl.float32)
    return x  # one return: Triton 3.6 types every return statement, taken or not


@triton.jit
def _accumulate(acc, x_ptr, stride_xm, M, w_lo, w_hi, scale, low, k, in_row, zero_n, ROW: tl.constexpr,
                HALF: tl.constexpr, KIND: tl.constexpr, SCALE: tl.constexpr, X_MODE: tl.constexpr,
                FOLD: tl.constexpr, INNER: tl.constexpr):
    """acc + row ROW of x times the widened weight tile (int4: both nibbles).
    Unfolded: element by element into acc (the tile's shape), each product one fused multiply-add (the
    scales are already in the weights). FOLD: each run's products summed in the thread (a chain of fused
    multiply-adds), then the run's scale applied into acc (the runs' shape); int4's m - 128 d times
    the run's sum of x (shared by the weight rows where x is)."""
    x_lo = _load_x(x_ptr, stride_xm, M, k, in_row, zero_n, ROW, X_MODE, INNER)
    if KIND == 0:
        x_hi = _load_x(x_ptr, stride_xm, M, k + HALF, in_row, zero_n, ROW, X_MODE, INNER)
    if FOLD:
        part = tl.sum(w_lo * x_lo, axis=2)
        if KIND == 0:
            part = part + tl.sum(w_hi * x_hi, axis=2)
        if SCALE == 1:  # (128 + q) d + (m - 128 d) summed over the run: d * part + (m - 128 d) * sum x
            acc = acc + part * scale + (tl.sum(x_lo, axis=2) + tl.sum(x_hi, axis=2)) * low
        elif SCALE == 2:
            acc = acc + part * scale
        else:
            acc = acc + part
    else:
        acc = acc + w_lo * x_lo
        if KIND == 0:
            acc = acc + w_hi * x_hi
    return acc


@triton.jit
def _load_step(w_rows, scale_ptr, min_ptr, rn, N, stride_sn, scale_rows, b0, run, run_start, ROW_BYTES,
               SCALE: tl.constexpr, GROUP: tl.constexpr, HALF: tl.constexpr, INNER: tl.constexpr):
    """One step's weight bytes (the tile) from byte b0 of each row (masked past the row's end), and its
    runs' scales: int4's group scale d and m - 128 d, the FP8 blocks' scale (twice), or for per-row
    scales a placeholder the caller never reads."""
    b = b0 + run
    w = tl.load(w_rows + _runs3(b, INNER), mask=_rows3(rn < N, INNER) & _runs3(b < ROW_BYTES, INNER), other=0)
    n2, s2 = _grid2(rn, b0 + run_start, INNER)
    s_ok = (n2 < N) & (s2 < ROW_BYTES)
    if SCALE == 1:  # int4, widened as 128 + q: (128 + q) d + (m - 128 d) = q d + m
        at = n2 * stride_sn + s2 // HALF
        scale = tl.load(scale_ptr + at, mask=s_ok, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + at, mask=s_ok, other=0.0).to(tl.float32) - 128.0 * scale
    elif SCALE == 2:  # FP8 blocks (a run never crosses one)
        at = (n2 // scale_rows) * stride_sn + s2 // GROUP
        scale = tl.load(scale_ptr + at, mask=s_ok, other=0.0).to(tl.float32)
        low = scale
    else:
        scale = s_ok.to(tl.float32)
        low = scale
    return w, scale, low


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, ROW_BYTES, stride_xm, stride_wn, stride_sn,
                 stride_om, scale_rows,
                 KIND: tl.constexpr, SCALE: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr,
                 BLOCK_N: tl.constexpr, SUBS: tl.constexpr, VEC: tl.constexpr, X_MODE: tl.constexpr,
                 ASM: tl.constexpr, FOLD: tl.constexpr, PREFETCH: tl.constexpr, INNER: tl.constexpr):
    """out[m, n] = sum_k x[m, k] w[n, k] for m < M <= ROWS <= 4, one program per BLOCK_N weight rows.

    KIND: 0 int4, 1 int8, 2 FP8. SCALE: 0 per row, 1 per group with a min (int4), 2 per block (FP8).
    GROUP: int4's group, or the FP8 blocks' width in columns (a run never crosses one); scale_rows: the
    FP8 blocks' height in rows. ASM: bytes widened by inline PTX (a GPU). X_MODE, FOLD: _load_x and
    _accumulate. PREFETCH: step i + 1's bytes and scales are loaded before step i is widened, so a
    load is in flight while the thread computes (registers for two steps). INNER: the tile is
    [SUBS, BLOCK_N, VEC], not [BLOCK_N, SUBS, VEC]: Triton spreads threads over the first axis of
    equal contiguity, so the threads split the runs and each holds all BLOCK_N rows of its runs, with
    x's run shared by them (else threads split the rows too and x's run is loaded per row). Rows of
    x are unrolled, one accumulator each, so the weight tile is widened once for all of them, and a
    row's sums never depend on the other rows (the same bits alone as in a batch)."""
    STEP: tl.constexpr = SUBS * VEC  # weight bytes per row per step
    HALF: tl.constexpr = GROUP // 2
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    run_start = tl.arange(0, SUBS) * VEC
    lane = tl.arange(0, VEC)[None, :]
    run = run_start[:, None] + lane  # [SUBS, VEC] byte offsets in a step
    w_rows = w_ptr + _rows3(rn, INNER) * stride_wn
    zero_n = _rows3(rn, INNER) * 0
    if INNER:
        RUNS_AXIS: tl.constexpr = 0
        if FOLD:  # one partial sum per run  # noqa: SIM108
            acc0 = tl.zeros((SUBS, BLOCK_N), dtype=tl.float32)
        else:  # one per weight
            acc0 = tl.zeros((SUBS, BLOCK_N, VEC), dtype=tl.float32)
    else:
        RUNS_AXIS: tl.constexpr = 1  # type: ignore[no-redef]  # a constexpr per branch, as Triton 3.6 compiled it
        if FOLD:  # noqa: SIM108
            acc0 = tl.zeros((BLOCK_N, SUBS), dtype=tl.float32)
        else:
            acc0 = tl.zeros((BLOCK_N, SUBS, VEC), dtype=tl.float32)
    acc1 = acc0
    acc2 = acc0
    acc3 = acc0
    if PREFETCH:
        w, scale, low = _load_step(w_rows, scale_ptr, min_ptr, rn, N, stride_sn, scale_rows, 0, run, run_start,
                                   ROW_BYTES, SCALE, GROUP, HALF, INNER)
    for b0 in range(0, ROW_BYTES, STEP):
        if PREFETCH:
            w_now, scale_now, low_now = w, scale, low
            w, scale, low = _load_step(w_rows, scale_ptr, min_ptr, rn, N, stride_sn, scale_rows, b0 + STEP, run,
                                       run_start, ROW_BYTES, SCALE, GROUP, HALF, INNER)
        else:
            w_now, scale_now, low_now = _load_step(w_rows, scale_ptr, min_ptr, rn, N, stride_sn, scale_rows, b0,
                                                   run, run_start, ROW_BYTES, SCALE, GROUP, HALF, INNER)
        in_row = b0 + run < ROW_BYTES
        w_lo, w_hi = _widen(w_now, KIND, ASM)
        if KIND == 0:  # byte j of a group holds k = j (low nibble) and k + GROUP / 2 (high nibble); a run
            # stays in one half group, so its k are contiguous (written so that Triton sees it and
            # loads x's run as whole 16-byte vectors)
            first = b0 + run_start
            k = ((first // HALF) * GROUP + first % HALF)[:, None] + lane
        else:
            k = b0 + run
        if not FOLD:  # the run's group or block scale, applied to the widened weights
            if SCALE == 1:
                w_lo = w_lo * scale_now[:, :, None] + low_now[:, :, None]
                w_hi = w_hi * scale_now[:, :, None] + low_now[:, :, None]
            elif SCALE == 2:
                w_lo = w_lo * scale_now[:, :, None]
                w_hi = w_lo
        acc0 = _accumulate(acc0, x_ptr, stride_xm, M, w_lo, w_hi, scale_now, low_now, k, in_row, zero_n, 0, HALF,
                           KIND, SCALE, X_MODE, FOLD, INNER)
        if ROWS > 1:
            acc1 = _accumulate(acc1, x_ptr, stride_xm, M, w_lo, w_hi, scale_now, low_now, k, in_row, zero_n, 1,
                               HALF, KIND, SCALE, X_MODE, FOLD, INNER)
        if ROWS > 2:
            acc2 = _accumulate(acc2, x_ptr, stride_xm, M, w_lo, w_hi, scale_now, low_now, k, in_row, zero_n, 2,
                               HALF, KIND, SCALE, X_MODE, FOLD, INNER)
            acc3 = _accumulate(acc3, x_ptr, stride_xm, M, w_lo, w_hi, scale_now, low_now, k, in_row, zero_n, 3,
                               HALF, KIND, SCALE, X_MODE, FOLD, INNER)
    n_ok = rn < N
    row_scale = tl.load(scale_ptr + rn, mask=n_ok, other=0.0) if SCALE == 0 else 1.0
    _store_row(out_ptr, acc0, row_scale, rn, n_ok, M, 0, FOLD, RUNS_AXIS)
    if ROWS > 1:
        _store_row(out_ptr + stride_om, acc1, row_scale, rn, n_ok, M, 1, FOLD, RUNS_AXIS)
    if ROWS > 2:
        _store_row(out_ptr + 2 * stride_om, acc2, row_scale, rn, n_ok, M, 2, FOLD, RUNS_AXIS)
        _store_row(out_ptr + 3 * stride_om, acc3, row_scale, rn, n_ok, M, 3, FOLD, RUNS_AXIS)


@triton.jit
def _store_row(out_row, acc, row_scale, rn, n_ok, M, ROW: tl.constexpr, FOLD: tl.constexpr,
               RUNS_AXIS: tl.constexpr):
    if FOLD:  # noqa: SIM108
        out = tl.sum(acc, axis=RUNS_AXIS)
    else:
        out = tl.sum(tl.sum(acc, axis=2), axis=RUNS_AXIS)
    tl.store(out_row + rn, (out * row_scale).to(out_row.dtype.element_ty), mask=n_ok & (rn * 0 + ROW < M))


def fits(x: torch.Tensor, fmt: str) -> bool:
    """Whether x [M, K] has few enough rows for this format's kernel to beat the format's other path."""
    return 1 <= x.shape[0] <= min(MAX_ROWS[fmt], ROWS_LIMIT)


def _launch(fmt: str, x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
            kind: int, scale_mode: int, group: int = 1, scale_rows: int = 1) -> torch.Tensor:
    m, n = x.shape[0], weight.shape[0]
    assert 1 <= m <= ROWS_LIMIT, f"{m} rows: these kernels take 1..{ROWS_LIMIT}"
    assert weight.stride(1) == 1 and scales.stride(-1) == 1, "weights and scales: rows contiguous"
    x = x if x.stride(1) == 1 else x.contiguous()
    tile = TILES[fmt]
    rows = triton.next_power_of_2(m)
    block_n = max(1, tile.block_n // rows)  # each row of x has its own accumulator: fewer weight rows per program
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scales, scales if mins is None else mins, out, m, n, weight.shape[1], x.stride(0),
        weight.stride(0), scales.stride(0), out.stride(0), scale_rows,
        KIND=kind, SCALE=scale_mode, GROUP=group, ROWS=rows, BLOCK_N=block_n,
        SUBS=tile.subs, VEC=tile.vec, X_MODE=2 if tile.x_once else 0 if tile.x_shared else 1,
        ASM=tile.asm and x.is_cuda, FOLD=tile.fold, PREFETCH=tile.prefetch, INNER=tile.rows_inner,
        num_warps=tile.warps)
    return out


def w4a16_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
               group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(packed uint8 [N, K / 2], scales/mins [N, K / group_size]).T -> [M, N] in x's dtype."""
    assert group_size >= 32 and group_size & (group_size - 1) == 0, \
        f"group_size must be a power of two >= 32, got {group_size}"
    assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == x.shape[1], "packed: uint8 [N, K / 2]"
    assert scales.shape == mins.shape == (packed.shape[0], x.shape[1] // group_size) and \
        scales.stride() == mins.stride(), "scales and mins: [N, K / group_size], the same layout"
    return _launch("int4", x, packed, scales, mins, _INT4, _GROUP_SCALE, group_size)


def w8a16_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (qweight int8 [N, K] * scales [N]).T -> [M, N] in x's dtype."""
    assert qweight.dtype == torch.int8 and qweight.shape[1] == x.shape[1], "qweight: int8 [N, K]"
    assert scales.shape == (qweight.shape[0],), "one scale per row"
    return _launch("int8", x, qweight, scales, None, _INT8, _ROW_SCALE)


def fp8_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (qweight float8_e4m3fn [N, K] * scales [N]).T -> [M, N]: weight-only, x stays as it is."""
    assert qweight.dtype == torch.float8_e4m3fn and qweight.shape[1] == x.shape[1], "qweight: float8_e4m3fn [N, K]"
    assert scales.shape == (qweight.shape[0],), "one scale per row"
    return _launch("fp8", x, qweight.view(torch.uint8), scales, None, _FP8, _ROW_SCALE)


def fp8_block_gemv(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                   block: tuple[int, int]) -> torch.Tensor:
    """x [M, K] @ (qweight float8_e4m3fn [N, K] with one scale per block of rows x cols).T -> [M, N]."""
    rows, cols = block
    n, k = qweight.shape
    assert qweight.dtype == torch.float8_e4m3fn and k == x.shape[1], "qweight: float8_e4m3fn [N, K]"
    assert cols % TILES["fp8_block"].vec == 0, f"blocks of {cols} columns: not whole runs of the kernel's loads"
    assert scales.shape == (triton.cdiv(n, rows), triton.cdiv(k, cols)), "scales: one per block"
    return _launch("fp8_block", x, qweight.view(torch.uint8), scales, None,
                   _FP8, _BLOCK_SCALE, cols, rows)
