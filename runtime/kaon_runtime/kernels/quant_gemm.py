"""Triton weight-only quantized GEMMs: W8A16 and W4A16, float32 accumulation.

Activations stay in their dtype (fp16, bf16 or fp32); the weights stay quantized in memory
and are widened tile by tile in registers. Layouts and the torch references: quant_gemm_ref.py.

Decode multiplies a handful of rows by the whole weight: one program per 64 output columns
would leave most SMs idle (a 4096-wide projection is 64 programs on a 132-SM H100) while
each walks all of K. Split-K cuts K into ranges run by separate programs; their float32
partial sums are added afterwards, so every SM streams its share of the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_N = 64
_BLOCK_K = 64  # int8 only; int4 steps one quantization group at a time
# int8 decode (M <= 16) steps 256 of K at a time: larger loads in flight per program. Measured
# on an H200 (bench/gpu/gemv_sweep.py, bench/RESULTS.md): 1.3x faster over Llama-3.1-8B's four
# projections at M = 1 than 64 (gate|up 51 -> 36 us). Prefill keeps 64 (not measured there).
_BLOCK_K_DECODE = 256


def _block_m(m: int) -> int:
    # tl.dot wants 16 rows at least; decode (M = 1) pads to that, prefill takes larger tiles.
    return 16 if m <= 16 else 64


def _warps(block_m: int) -> int:
    # 64-row tiles hold four times the accumulator: with 8 warps W4A16 needs 125 registers per
    # thread on sm_90 instead of 207 (tests/unit/runtime/kernels/test_kernels_compile.py), W8A16 48 instead of 77.
    return 4 if block_m <= 16 else 8


def _split_k(m: int, n_blocks: int, k_steps: int, device: torch.device) -> int:
    """K ranges per output tile: enough programs for about two per SM, for small M on a GPU only."""
    if device.type != "cuda" or m > 16:
        return 1  # the interpreter runs programs one by one, and large M already fills the GPU
    target = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(k_steps, triton.cdiv(target, n_blocks)))


def _precision(dtype: torch.dtype) -> str:
    # float32 activations get float32 products, not TF32's 10-bit mantissa; half types ignore the setting.
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def _store(out_ptr, acc, rm, rn, M, N, stride_om, stride_os):
    """One K range's result: straight into the output, or its float32 slice of the partial sums."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    tl.store(out_ptr + tl.program_id(2) * stride_os + rm[:, None] * stride_om + rn[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _w8a16_kernel(x_ptr, w_ptr, scale_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_om,
                  stride_os, steps_per_split,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
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
        w = tl.load(w_ptr + rn[None, :] * stride_wn + k[:, None],
                    mask=(rn[None, :] < N) & (k[:, None] < K), other=0)
        # int8 is exact in any float type, so multiplying x by the raw integers loses nothing.
        acc += tl.dot(x, w.to(x.dtype), input_precision=PRECISION)
    scale = tl.load(scale_ptr + rn, mask=rn < N, other=0.0)
    _store(out_ptr, acc * scale[None, :], rm, rn, M, N, stride_om, stride_os)


@triton.jit
def _w4a16_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn, stride_gn,
                  stride_om, stride_os, steps_per_split,
                  GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rh = tl.arange(0, HALF)
    row_ok, col_ok = rm < M, rn < N
    first = tl.program_id(2) * steps_per_split
    last = tl.minimum(K // GROUP, first + steps_per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(first, last):
        x_row = x_ptr + rm[:, None] * stride_xm
        x_lo = tl.load(x_row + (g * GROUP + rh[None, :]) * stride_xk, mask=row_ok[:, None], other=0.0)
        x_hi = tl.load(x_row + (g * GROUP + HALF + rh[None, :]) * stride_xk, mask=row_ok[:, None], other=0.0)
        packed = tl.load(w_ptr + rn[None, :] * stride_wn + g * HALF + rh[:, None], mask=col_ok[None, :], other=0)
        # Low nibbles are the group's first half, high nibbles its second: two dots, no interleave.
        q_lo = (packed & 0xF).to(x_lo.dtype)
        q_hi = (packed >> 4).to(x_lo.dtype)
        dots = tl.dot(x_lo, q_lo, input_precision=PRECISION) + tl.dot(x_hi, q_hi, input_precision=PRECISION)
        # sum_k x (q d + m) = d (x . q) + m (sum x): scale and min apply once per group, not per weight.
        x_sum = tl.sum(x_lo.to(tl.float32), axis=1) + tl.sum(x_hi.to(tl.float32), axis=1)
        scale = tl.load(scale_ptr + rn * stride_gn + g, mask=col_ok, other=0.0).to(tl.float32)
        low = tl.load(min_ptr + rn * stride_gn + g, mask=col_ok, other=0.0).to(tl.float32)
        acc += dots * scale[None, :] + x_sum[:, None] * low[None, :]
    _store(out_ptr, acc, rm, rn, M, N, stride_om, stride_os)


def _launch(kernel, x: torch.Tensor, weights: tuple, weight_strides: tuple, n: int, k_steps: int,
            split_k: int | None, block_n: int = _BLOCK_N, **options) -> torch.Tensor:
    """Run `kernel` over (row tiles, column tiles, K ranges) and add up the ranges' partial sums.
    `options`: the kernel's constexprs, and Triton's num_stages / num_warps where given
    (bench/gpu/gemv_sweep.py tries tile shapes through here)."""
    m = x.shape[0]
    block_m, n_blocks = _block_m(m), triton.cdiv(n, block_n)
    splits = _split_k(m, n_blocks, k_steps, x.device) if split_k is None else max(1, min(split_k, k_steps))
    # One range writes the output in x's dtype; several write float32 partials, summed once at the end.
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    if m:
        kernel[(triton.cdiv(m, block_m), n_blocks, splits)](
            x, *weights, out, m, n, x.shape[1], x.stride(0), x.stride(1), *weight_strides,
            out.stride(-2), out.stride(0) if splits > 1 else 0, triton.cdiv(k_steps, splits),
            **({"BLOCK_M": block_m, "BLOCK_N": block_n, "PRECISION": _precision(x.dtype),
                "num_warps": _warps(block_m)} | options))
    return out if splits == 1 else out.sum(0).to(x.dtype)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32) @ (qweight int8 [N, K] * scales [N]).T -> [M, N] in x's dtype.

    split_k: K ranges per output tile; None picks from the device (tests force it).
    """
    assert x.dim() == 2 and qweight.dim() == 2 and x.shape[1] == qweight.shape[1], "x [M, K], qweight [N, K]"
    assert qweight.dtype == torch.int8 and qweight.stride(1) == 1, "qweight: int8, rows contiguous"
    assert scales.shape == (qweight.shape[0],) and scales.is_contiguous(), "one scale per output row"
    block_k = _BLOCK_K_DECODE if x.shape[0] <= 16 else _BLOCK_K
    return _launch(_w8a16_kernel, x, (qweight, scales), (qweight.stride(0),), qweight.shape[0],
                   triton.cdiv(x.shape[1], block_k), split_k, BLOCK_K=block_k)


def w4a16_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] @ dequant(packed uint8 [N, K / 2], scales/mins [N, K / group_size]).T -> [M, N]."""
    assert x.dim() == 2 and packed.dim() == 2, "x [M, K], packed [N, K / 2]"
    k, n = x.shape[1], packed.shape[0]
    assert group_size >= 32 and group_size & (group_size - 1) == 0, \
        f"group_size must be a power of two >= 32 (each half-group feeds a tl.dot), got {group_size}"
    assert k % group_size == 0, f"K = {k} is not a multiple of the group size {group_size}"
    assert packed.dtype == torch.uint8 and packed.shape[1] * 2 == k and packed.stride(1) == 1, \
        "packed: uint8 [N, K / 2], rows contiguous"
    groups = (n, k // group_size)
    assert scales.shape == groups and mins.shape == groups, f"scales and mins must be {groups}"
    assert scales.stride() == mins.stride() and scales.stride(1) == 1, "scales and mins: same row-major layout"
    return _launch(_w4a16_kernel, x, (packed, scales, mins), (packed.stride(0), scales.stride(0)), n,
                   k // group_size, split_k, GROUP=group_size)
