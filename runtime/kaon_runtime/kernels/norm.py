"""Triton RMSNorm, fused with the residual add before it. Reference: layers.norm.RMSNorm.

Rounds where the torch path rounds: the sum to the model dtype (so the residual stream is
bit-identical), the normalised row to the model dtype before the weight.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, stride_xr, stride_xc,
                     stride_rr, stride_rc, hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_xr + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rr + cols * stride_rc, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    normed = (x * inv_rms).to(dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, (weight * normed).to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """x [T, hidden] (any strides) -> weight * x / rms(x); with a residual, (norm(x + residual), x + residual)."""
    rows, hidden = x.shape
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.dtype == x.dtype
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)
    out = torch.empty(rows, hidden, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(hidden)
        source = residual if residual is not None else x  # a stand-in pointer the kernel never reads
        _rms_norm_kernel[(rows,)](
            x, source, weight, out, residual_out if residual is not None else out, x.stride(0), x.stride(1),
            source.stride(0), source.stride(1), hidden, eps, HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8))
    return out if residual is None else (out, residual_out)
