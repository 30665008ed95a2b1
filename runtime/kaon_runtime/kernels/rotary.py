"""Triton rotary embedding in HF's split-halves layout. Reference: layers.rotary.apply_rotary.

Dimension i pairs with i + D/2 (not with its neighbour as in the interleaved GPT-J layout),
rotated by the angle of frequency i, in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 16  # heads per program


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token, head_block = tl.program_id(0), tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    cos = tl.load(cos_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    # Both halves are read before either is written, so out may be x itself.
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None):
    """x [T, heads, D] rotated by cos/sin ([T, D/2] or [T, 1, D/2], float32) into out (pass x for in place)."""
    tokens, heads, dim = x.shape
    half = dim // 2
    assert dim % 2 == 0 and x.stride(2) == 1, "head_dim must be even and contiguous"
    for table in (cos, sin):
        assert table.numel() == tokens * half and table.is_contiguous() and table.dtype == torch.float32
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(2) == 1
    if tokens:
        _rotary_kernel[(tokens, triton.cdiv(heads, _BLOCK_H))](
            x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), heads,
            HALF=half, BLOCK_H=_BLOCK_H, BLOCK_HALF=triton.next_power_of_2(half))
    return out
