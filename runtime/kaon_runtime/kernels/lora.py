"""Triton kernels of batched LoRA, one adapter slot per token (Punica's BGMV shape): shrink
x @ A[slot].T into a rank-wide buffer, then expand it by B[slot] into the projection's output.
Reference: kernels.lora_ref (the layouts are described there).

Each program reads its token's slot and loads only that adapter's weights, so any mix of
adapters (and of base tokens, slot -1, which return at once) runs in one launch per projection.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_K = 64  # input features per step of the shrink's reduction
_BLOCK_N = 64  # output features per program of the expand


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slots_ptr, out_ptr, fan_in, rank, stride_x, stride_as, stride_ar, stride_out,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, fan_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_x + k, mask=k < fan_in, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < fan_in), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + token * stride_out + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(y_ptr, shrunk_ptr, b_ptr, slots_ptr, fan_out, rank, stride_y, stride_shrunk, stride_bs, stride_br,
                   BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    token, block = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + token)
    if slot < 0:
        return
    r = tl.arange(0, BLOCK_R)
    n = block * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.load(shrunk_ptr + token * stride_shrunk + r, mask=r < rank, other=0.0)
    b = tl.load(b_ptr + slot * stride_bs + r[None, :] * stride_br + n[:, None],
                mask=(n[:, None] < fan_out) & (r[None, :] < rank), other=0.0).to(tl.float32)
    added = tl.sum(b * s[None, :], axis=1)
    y = tl.load(y_ptr + token * stride_y + n, mask=n < fan_out, other=0.0).to(tl.float32)
    tl.store(y_ptr + token * stride_y + n, (y + added).to(y_ptr.dtype.element_ty), mask=n < fan_out)


def lora_shrink(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in], A [S, R, in], slots [T] -> float32 [T, R] (rows of slot -1 are zeros)."""
    tokens, fan_in = x.shape
    _, rank, a_in = a.shape
    assert a_in == fan_in and slots.shape == (tokens,), "x, A and slots disagree"
    assert x.stride(1) == 1 and a.stride(2) == 1, "rows must be contiguous"
    out = torch.zeros(tokens, rank, dtype=torch.float32, device=x.device)
    if tokens:
        _shrink_kernel[(tokens,)](x, a, slots, out, fan_in, rank, x.stride(0), a.stride(0), a.stride(1),
                                  out.stride(0), BLOCK_R=triton.next_power_of_2(rank), BLOCK_K=_BLOCK_K)
    return out


def lora_expand(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """y [T, out] += shrunk [T, R] @ B[slot] with B [S, R, out], in place (y and B may be column slices)."""
    tokens, fan_out = y.shape
    _, rank, b_out = b.shape
    assert b_out == fan_out and shrunk.shape == (tokens, rank) and slots.shape == (tokens,), "y, B and slots disagree"
    assert y.stride(1) == 1 and b.stride(2) == 1 and shrunk.stride(1) == 1, "rows must be contiguous"
    if tokens:
        grid = (tokens, triton.cdiv(fan_out, _BLOCK_N))
        _expand_kernel[grid](y, shrunk, b, slots, fan_out, rank, y.stride(0), shrunk.stride(0), b.stride(0),
                             b.stride(1), BLOCK_R=triton.next_power_of_2(rank), BLOCK_N=_BLOCK_N)
