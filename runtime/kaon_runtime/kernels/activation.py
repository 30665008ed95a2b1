"""Triton SiLU-and-multiply on the fused gate|up projection. Reference: layers.activation.silu_and_mul."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, intermediate, BLOCK: tl.constexpr):
    row, col_block = tl.program_id(0), tl.program_id(1)
    cols = col_block * BLOCK + tl.arange(0, BLOCK)
    mask = cols < intermediate
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + intermediate + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * intermediate + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 * I] = gate | up -> silu(gate) * up [T, I], computed in float32."""
    rows, width = x.shape
    assert width % 2 == 0 and x.stride(1) == 1, "gate|up rows must be contiguous"
    intermediate = width // 2
    out = torch.empty(rows, intermediate, dtype=x.dtype, device=x.device)
    if rows:
        block = min(_BLOCK, triton.next_power_of_2(intermediate))
        _silu_and_mul_kernel[(rows, triton.cdiv(intermediate, block))](x, out, x.stride(0), intermediate, BLOCK=block)
    return out
