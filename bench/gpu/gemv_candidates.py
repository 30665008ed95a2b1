"""Kernels tried by gemv_sweep.py before any is promoted into kaon_runtime.kernels.

The first GPU run found kaon's W4A16 kernel 0.33-0.45x cuBLAS bf16 at M = 1 although it reads a
third of the bytes: bound by instructions (16 bytes a column per step, two dots on M padded to
16, a float conversion per nibble), not by memory. The candidate here is a matrix-vector
product without `tl.dot`: one program row per activation row, several groups per step, nibbles
times activations summed per group in float32, and each group's scale and min applied once to
that sum (sum_k x (q d + m) = d (x . q) + m (sum x)), so the weights are never widened to a
matrix. Exact in float32 against the reference, like the runtime kernel. A candidate moves into
the runtime (with its tests) only once a GPU run shows it faster.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _w4a16_gemv_kernel(x_ptr, w_ptr, scale_ptr, min_ptr, out_ptr, N, K, stride_xm, stride_wn, stride_gn, stride_om,
                       stride_os, steps_per_split,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, GROUPS_PER_STEP: tl.constexpr):
    HALF: tl.constexpr = GROUP // 2
    m = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rg = tl.arange(0, GROUPS_PER_STEP)
    rh = tl.arange(0, HALF)
    col_ok = rn < N
    first = tl.program_id(2) * steps_per_split
    last = tl.minimum(K // (GROUP * GROUPS_PER_STEP), first + steps_per_split)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for step in range(first, last):
        g = step * GROUPS_PER_STEP + rg  # the step's groups
        # Byte j of group g holds k = g * GROUP + j (low nibble) and k + HALF (high nibble).
        packed = tl.load(w_ptr + rn[:, None, None] * stride_wn + (g * HALF)[None, :, None] + rh[None, None, :],
                         mask=col_ok[:, None, None], other=0)
        x_row = x_ptr + m * stride_xm + (g * GROUP)[:, None] + rh[None, :]
        x_lo = tl.load(x_row).to(tl.float32)
        x_hi = tl.load(x_row + HALF).to(tl.float32)
        q_lo, q_hi = (packed & 0xF).to(tl.float32), (packed >> 4).to(tl.float32)
        dots = tl.sum(q_lo * x_lo[None, :, :] + q_hi * x_hi[None, :, :], axis=2)
        x_sum = tl.sum(x_lo + x_hi, axis=1)
        scale = tl.load(scale_ptr + rn[:, None] * stride_gn + g[None, :], mask=col_ok[:, None], other=0.0)
        low = tl.load(min_ptr + rn[:, None] * stride_gn + g[None, :], mask=col_ok[:, None], other=0.0)
        acc += tl.sum(dots * scale.to(tl.float32) + x_sum[None, :] * low.to(tl.float32), axis=1)
    tl.store(out_ptr + tl.program_id(2) * stride_os + m * stride_om + rn, acc.to(out_ptr.dtype.element_ty),
             mask=col_ok)


def w4a16_gemv(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               block_n: int = 32, groups_per_step: int = 4, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (contiguous, small M) @ dequant(packed [N, K / 2], scales/mins [N, K / group_size]).T."""
    m, k = x.shape
    n = packed.shape[0]
    assert x.stride(1) == 1 and k % (group_size * groups_per_step) == 0
    steps = k // (group_size * groups_per_step)
    n_blocks = triton.cdiv(n, block_n)
    if split_k is None:  # about two programs per SM, as the runtime kernel does
        target = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 1
        split_k = max(1, min(steps, triton.cdiv(target, n_blocks * m)))
    splits = max(1, min(split_k, steps))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if splits == 1 else \
        torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _w4a16_gemv_kernel[(m, n_blocks, splits)](
        x, packed, scales, mins, out, n, k, x.stride(0), packed.stride(0), scales.stride(0), out.stride(-2),
        out.stride(0) if splits > 1 else 0, triton.cdiv(steps, splits),
        GROUP=group_size, BLOCK_N=block_n, GROUPS_PER_STEP=groups_per_step, num_warps=4)
    return out if splits == 1 else out.sum(0).to(x.dtype)
