"""Batch-invariant GEMMs for the GPU (issue 49 §2; layers/kernel_backend.py `batch_invariant`).

A row's output must not depend on the rows beside it. cuBLAS (F.linear) and quant_gemm.py pick their
kernels, tiles and split-K by the row count M, so a token's numbers move with the step's size (batch
neighbours, prefill chunks, prefix-cache hits). Here everything that decides the order in which an
output element is summed comes from the weight's shape and dtype alone (`config`):

- one tile (BLOCK_M x BLOCK_N x BLOCK_K, warps, stages) per (N, K, dtype); BLOCK_M is fixed, so a row is
  one row of the same tl.dot whatever M is (the padding rows are masked to zero);
- float32 accumulators; float32 activations multiply in IEEE float32 (no TF32), as F.linear does;
- split-K: batch-1 decode of a 4096-wide projection is 32 column tiles of 128, far too few programs for a
  132-SM H200 to stream the weight at its bandwidth, so K is cut into `splits` ranges run by separate
  programs. The count comes from (N, K) alone (`split_count`), each range writes its float32 partial sums,
  and a second kernel adds them in range order (no atomics, whose order would be the scheduler's).

Thinking Machines' batch_invariant_ops and vLLM's batch-invariant mode use one persistent GEMM per dtype
with no split-K, and accept slow small-M steps for it; the split by (N, K) is what this module adds. The
same launcher runs quant_gemm.py's int4 / int8 tl.dot kernels at a fixed tile (`matmul_fixed`), so the
quantized linears get the same guarantee under the switch (quant/*.py).

What the CPU tests (Triton's interpreter) can and cannot show: tests/unit/runtime/kernels/test_invariant_gemm.py.
Untried on a GPU until a lease measures it (bench/gpu/invariant_gemm.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# Programs a launch aims at (M = 1): an H200's 132 SMs. A constant, not the device's count, so that every
# GPU a service runs on splits a weight the same way (two replicas answer alike).
TARGET_PROGRAMS = 132
MAX_SPLITS = 8
MIN_STEPS_PER_SPLIT = 4  # a range shorter than 4 K-steps costs more in partial sums than it gains

_DENSE, _FP8, _FP8_BLOCKS = 0, 1, 2


@dataclass(frozen=True, slots=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    splits: int  # K ranges (1: no split)
    warps: int = 4
    stages: int = 3


def split_count(n: int, k: int, block_n: int, block_k: int) -> int:
    """K ranges per column tile: enough programs for about one per SM at M = 1, from (N, K) alone."""
    tiles, steps = triton.cdiv(n, block_n), triton.cdiv(k, block_k)
    return max(1, min(MAX_SPLITS, steps // MIN_STEPS_PER_SPLIT, triton.cdiv(TARGET_PROGRAMS, tiles)))


def config(n: int, k: int, dtype: torch.dtype) -> Config:
    """The one tile for a weight [N, K] multiplied in `dtype`: never a function of M (the point of the module).
    64 rows: Hopper's warpgroup MMA is 64 rows tall, and at M = 1 a 64-row tile of 16-bit weights is still
    bound by memory (64 multiply-adds per weight read). float32 takes narrower tiles (its dot is IEEE FMAs)."""
    if dtype == torch.float32:
        block_n, block_k, warps = 64, 32, 4
    else:
        block_n, block_k, warps = 128, 64, 4
    return Config(64, block_n, block_k, split_count(n, k, block_n, block_k), warps)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # half types ignore it


def _interpreted_bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16 and not x.is_cuda


@triton.jit
def _gemm_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_wk,
                 stride_om, stride_os, steps_per_split, stride_sn,
                 WEIGHT: tl.constexpr, FINAL: tl.constexpr, HAS_BIAS: tl.constexpr, SCALE_ROWS: tl.constexpr,
                 SCALE_COLS: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr):
    """One (row tile, column tile, K range): acc = x[rows, range] @ w[cols, range].T in float32.
    WEIGHT 0: w in x's dtype; 1: FP8 e4m3 bytes widened to x's dtype (exact), times a scale per column
    (weight-only, W8A16); 2: FP8 bytes times their block's scale (scale_ptr [ceil(N / SCALE_ROWS), ceil(K /
    SCALE_COLS)], row stride stride_sn) in float32, rounded to x's dtype: Fp8BlockLinear's dequantized weight
    exactly, never held whole. FINAL (one range): scale and bias applied and the result stored in x's dtype;
    else the float32 partial sums stored at slice program_id(2) of the partials. DOT_F32: the operands
    widened to float32 first (Triton 3.9's interpreter multiplies bfloat16 operands as integers; the
    products of two bfloat16 values are exact in float32, so the values are the same)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    first = tl.program_id(2) * steps_per_split * BLOCK_K
    last = tl.minimum(K, first + steps_per_split * BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, last, BLOCK_K):
        k = k0 + rk
        x = tl.load(x_ptr + rm[:, None] * stride_xm + k[None, :] * stride_xk,
                    mask=(rm[:, None] < M) & (k[None, :] < K), other=0.0)
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None] * stride_wk,
                    mask=(rn[None, :] < N) & (k[:, None] < K), other=0)
        if WEIGHT == 1:  # bytes read as e4m3 (a masked byte is 0, not NaN); every e4m3 value fits x's dtype
            w = w.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        elif WEIGHT == 2:
            block_scale = tl.load(scale_ptr + (rn[None, :] // SCALE_ROWS) * stride_sn + k[:, None] // SCALE_COLS,
                                  mask=(rn[None, :] < N) & (k[:, None] < K), other=0.0)
            w = (w.to(tl.float8e4nv, bitcast=True).to(tl.float32) * block_scale).to(x_ptr.dtype.element_ty)
        if DOT_F32:
            acc += tl.dot(x.to(tl.float32), w.to(x.dtype).to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if FINAL:
        out = _epilogue(acc, scale_ptr, bias_ptr, rn, N, WEIGHT == 1, HAS_BIAS)
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + tl.program_id(2) * stride_os + rm[:, None] * stride_om + rn[None, :], acc, mask=mask)


@triton.jit
def _epilogue(acc, scale_ptr, bias_ptr, rn, N, HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr):
    """float32 sums -> (sums * column scale) + bias, in float32: the same steps whether K was split or not."""
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if HAS_BIAS:
        acc = acc + tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return acc


@triton.jit
def _sum_splits_kernel(part_ptr, scale_ptr, bias_ptr, out_ptr, SPLITS, M, N, stride_ps, stride_pm, stride_om,
                       HAS_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """out = epilogue(part[0] + part[1] + ... + part[SPLITS - 1]), added in that order for every element."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    at = rm[:, None] * stride_pm + rn[None, :]
    acc = tl.load(part_ptr + at, mask=mask, other=0.0)
    for s in range(1, SPLITS):
        acc += tl.load(part_ptr + s * stride_ps + at, mask=mask, other=0.0)
    out = _epilogue(acc, scale_ptr, bias_ptr, rn, N, HAS_SCALE, HAS_BIAS)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(partials: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """float32 partials [S, M, N] -> [M, N] in `dtype`, summed in range order (torch's sum(0) picks its own
    reduction order by the tensor's shape), then times `scale` [N] and plus `bias` [N] in float32."""
    splits, m, n = partials.shape
    out = torch.empty(m, n, dtype=dtype, device=partials.device)
    block_m, block_n = 16, 128
    _sum_splits_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        partials, partials if scale is None else scale, partials if bias is None else bias, out, splits, m, n,
        partials.stride(0), partials.stride(1), out.stride(0),
        HAS_SCALE=scale is not None, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n)
    return out


def matmul_fixed(kernel, x: torch.Tensor, weights: tuple, weight_strides: tuple, n: int, k_steps: int, cfg: Config,
                 **constexprs) -> torch.Tensor:
    """Run `kernel` (quant_gemm.py's calling convention: x, *weights, out, M, N, K, x's strides,
    *weight_strides, out's row and range strides, K steps per range) at the tile `cfg` over
    (row tiles, column tiles, K ranges); several ranges' float32 partials are added by sum_splits.
    `k_steps`: the kernel's K steps (BLOCK_K columns each, or int4's groups)."""
    m = x.shape[0]
    per_split = triton.cdiv(k_steps, max(1, min(cfg.splits, k_steps)))
    splits = triton.cdiv(k_steps, per_split)  # no empty range
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m:
        kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
            x, *weights, out, m, n, x.shape[1], x.stride(0), x.stride(1), *weight_strides,
            out.stride(-2), out.stride(0) if splits > 1 else 0, per_split,
            **({"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "PRECISION": _precision(x.dtype),
                "num_warps": cfg.warps, "num_stages": cfg.stages} | constexprs))
    return out if splits == 1 else sum_splits(out, x.dtype)


def _gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
          kind: int, cfg: Config | None, block_scales: torch.Tensor | None = None, block: tuple[int, int] = (1, 1)
          ) -> torch.Tensor:
    """scale: one per output column, applied after the sum; block_scales: FP8 blocks' (kind _FP8_BLOCKS)."""
    n, k = weight.shape
    assert x.dim() == 2 and x.shape[1] == k, f"x [M, {k}] for a weight [{n}, {k}], got {tuple(x.shape)}"
    assert bias is None or bias.shape == (n,), "one bias per output column"
    cfg = cfg or config(n, k, x.dtype)
    k_steps = triton.cdiv(k, cfg.block_k)
    m = x.shape[0]
    per_split = triton.cdiv(k_steps, max(1, min(cfg.splits, k_steps)))
    splits = triton.cdiv(k_steps, per_split)
    final = splits == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if final else \
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m:
        _gemm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)](
            x, weight, next(t for t in (scale, block_scales, weight) if t is not None),
            weight if bias is None else bias, out, m, n, k, x.stride(0), x.stride(1), weight.stride(0),
            weight.stride(1), out.stride(-2), 0 if final else out.stride(0), per_split,
            0 if block_scales is None else block_scales.stride(0),
            WEIGHT=kind, FINAL=final, HAS_BIAS=bias is not None, SCALE_ROWS=block[0], SCALE_COLS=block[1],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, PRECISION=_precision(x.dtype), DOT_F32=_interpreted_bf16(x),
            num_warps=cfg.warps, num_stages=cfg.stages)
    return out if final else sum_splits(out, x.dtype, scale, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           cfg: Config | None = None) -> torch.Tensor:
    """F.linear(x [M, K], weight [N, K] (any strides: the vocabulary head's [K, N] table transposed is
    fine), bias [N]) -> [M, N] in x's dtype, each row's numbers independent of M. `cfg`: tests force a tile."""
    assert weight.dtype == x.dtype, f"weight {weight.dtype} and x {x.dtype} must match"
    return _gemm(x, weight, None, bias, _DENSE, cfg)


def fp8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, cfg: Config | None = None) -> torch.Tensor:
    """x [M, K] @ (qweight float8_e4m3fn [N, K] * scales [N]).T -> [M, N]: weight-only, x as it is (quant/fp8.py's
    fp8_matmul_ref, summed in float32 by tiles fixed by the weight's shape)."""
    assert qweight.dtype == torch.float8_e4m3fn and scales.shape == (qweight.shape[0],), "fp8 [N, K], scales [N]"
    return _gemm(x, qweight.view(torch.uint8), scales.float().contiguous(), None, _FP8, cfg)


# The quantized formats' tiles for quant_gemm.py's kernels under the switch. 16 rows (tl.dot's least), not
# 64: at M = 1 a 64-row tile would widen each 4-bit weight for 64 multiply-adds, past the memory's pace;
# prefill pays with more re-widening of each weight tile (bench/gpu/invariant_gemm.py measures both).
_QUANT_BLOCK_M, _QUANT_BLOCK_N = 16, 64
_INT8_BLOCK_K = 256  # quant_gemm's decode step (its default path's measured choice at M <= 16)


def w8a16_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, cfg: Config | None = None
                 ) -> torch.Tensor:
    """quant_gemm.w8a16_matmul at one tile for every M: x [M, K] @ (int8 [N, K] * scales [N]).T -> [M, N]."""
    from kaon_runtime.kernels import quant_gemm
    n, k = qweight.shape
    assert x.dim() == 2 and x.shape[1] == k and qweight.dtype == torch.int8 and qweight.stride(1) == 1
    assert scales.shape == (n,) and scales.is_contiguous(), "one scale per output row"
    cfg = cfg or Config(_QUANT_BLOCK_M, _QUANT_BLOCK_N, _INT8_BLOCK_K,
                        split_count(n, k, _QUANT_BLOCK_N, _INT8_BLOCK_K))
    return matmul_fixed(quant_gemm._w8a16_kernel, x, (qweight, scales), (qweight.stride(0),), n,
                        triton.cdiv(k, cfg.block_k), cfg, BLOCK_K=cfg.block_k)


def w4a16_linear(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 cfg: Config | None = None) -> torch.Tensor:
    """quant_gemm.w4a16_matmul at one tile for every M (its layouts; one K step per quantization group)."""
    from kaon_runtime.kernels import quant_gemm
    n, k = packed.shape[0], x.shape[1]
    assert group_size >= 32 and group_size & (group_size - 1) == 0 and k % group_size == 0
    assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == k and packed.stride(1) == 1
    assert scales.shape == mins.shape == (n, k // group_size) and scales.stride() == mins.stride()
    cfg = cfg or Config(_QUANT_BLOCK_M, _QUANT_BLOCK_N, group_size, split_count(n, k, _QUANT_BLOCK_N, group_size))
    return matmul_fixed(quant_gemm._w4a16_kernel, x, (packed, scales, mins), (packed.stride(0), scales.stride(0)),
                        n, k // group_size, cfg, GROUP=group_size)


def fp8_block_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, block: tuple[int, int],
                     cfg: Config | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize_fp8_blocks(qweight, scales, block).to(x.dtype).T -> [M, N] (Fp8BlockLinear's GPU path:
    the same weight values), each block-scaled weight formed in the tile, not widened whole first."""
    n, k = qweight.shape
    assert qweight.dtype == torch.float8_e4m3fn, "qweight: float8_e4m3fn [N, K]"
    assert scales.shape == (triton.cdiv(n, block[0]), triton.cdiv(k, block[1])) and scales.stride(1) == 1, \
        "scales: one per block, rows contiguous"
    return _gemm(x, qweight.view(torch.uint8), None, None, _FP8_BLOCKS, cfg, scales.float(), block)
