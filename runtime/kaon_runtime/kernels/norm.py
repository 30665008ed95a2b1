"""Triton RMSNorm, fused with the residual add before it. Reference: layers.norm.RMSNorm.

Rounds where the torch path rounds: the sum to the model dtype (so the residual stream is
bit-identical), the normalised row to the model dtype before the weight; with a weight offset
(Gemma's norms: the checkpoint stores weight - 1) the scaling in float32, then one rounding.

One program per row, its tile and warps set by the row's width alone, so a row's result does not
depend on how many rows the step has (issue 49 §2). torch's own reduction does not promise that (on a
GPU it splits a row across more threads when there are few rows), so with KAON_GPU_BATCH_INVARIANT the
norms torch would compute otherwise (Gemma's offset and sandwich norms, Qwen3's q/k norms over head
views [T, H, D]) come here too (models/decoder.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr, stride_xr, stride_xc,
                     stride_rr, stride_rc, hidden, eps, heads, stride_xh, weight_offset,
                     HAS_RESIDUAL: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # token * heads + head: a [T, H, D] view's rows (heads 1: a plain [T, hidden])
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x_row = x_ptr + (row // heads).to(tl.int64) * stride_xr + (row % heads) * stride_xh
    x = tl.load(x_row + cols * stride_xc, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_rr + cols * stride_rc, mask=mask, other=0.0)
        x = (x + residual.to(tl.float32)).to(dtype)
        tl.store(residual_out_ptr + row * hidden + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, 0) / hidden + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if OFFSET:  # noqa: SIM108  (a compile-time branch: two variants of the kernel)
        out = (x * inv_rms) * (weight_offset + weight)
    else:
        out = weight * (x * inv_rms).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * hidden + cols, out.to(dtype), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
             weight_offset: float = 0.0):
    """x [T, hidden] (any strides) -> weight * x / rms(x); with a residual, (norm(x + residual), x + residual).
    x may be [T, H, D] (a head view, any strides; no residual): each head's row normalised alone.
    weight_offset: (weight_offset + weight) * x / rms(x) in float32, rounded once (layers.norm.RMSNorm)."""
    heads, stride_xh = (x.shape[1], x.stride(1)) if x.dim() == 3 else (1, 0)
    assert x.dim() in (2, 3) and (residual is None or x.dim() == 2), "a residual goes with a [T, hidden] input"
    rows, hidden = x.shape[0] * heads, x.shape[-1]
    assert weight.shape == (hidden,) and weight.is_contiguous() and weight.dtype == x.dtype
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out) if residual is not None else None
    if rows:
        block = triton.next_power_of_2(hidden)
        source = residual if residual is not None else x  # a stand-in pointer the kernel never reads
        _rms_norm_kernel[(rows,)](
            x, source, weight, out, residual_out if residual is not None else out, x.stride(0), x.stride(-1),
            source.stride(0), source.stride(-1), hidden, eps, heads, stride_xh, float(weight_offset),
            HAS_RESIDUAL=residual is not None, OFFSET=weight_offset != 0, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8))
    return out if residual is None else (out, residual_out)
