"""Weight-only quantized matmuls in plain torch: dequantize, then matmul in float32.

These are the references the Triton kernels in quant_gemm.py are tested against, and the
path the quantized linears take where Triton does not run (CPU). No Triton import here.

Layouts (rows are output channels, as in nn.Linear's [out, in] weight):
- int8: qweight int8 [N, K], one float32 scale per row: w = q * scale.
- int4: packed uint8 [N, K / 2], fp16 scales and mins [N, K / group_size]: w = q * scale + min,
  q in 0..15. Within a group, byte j holds element j in its low nibble and element
  j + group_size / 2 in its high nibble. With group_size 32 this is exactly the `qs` field
  of a GGUF Q4_1 block, so those blocks load without touching a bit.
"""
from __future__ import annotations

import torch


def dequantize_int8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return qweight.float() * scales.float()[:, None]


def unpack_int4(packed: torch.Tensor, group_size: int) -> torch.Tensor:
    """uint8 [N, K / 2] -> the 4-bit values as uint8 [N, K], in weight order."""
    rows = packed.shape[0]
    halves = packed.reshape(rows, -1, group_size // 2)
    return torch.cat([halves & 0xF, halves >> 4], dim=-1).reshape(rows, -1)


def pack_int4(q: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of unpack_int4: uint8 values 0..15 [N, K] -> uint8 [N, K / 2]."""
    rows = q.shape[0]
    halves = q.reshape(rows, -1, 2, group_size // 2)
    return (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(rows, -1)


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                    group_size: int) -> torch.Tensor:
    rows = packed.shape[0]
    q = unpack_int4(packed, group_size).reshape(rows, -1, group_size).float()
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(rows, -1)


def w8a16_matmul_ref(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequant(qweight).T -> [M, N] in x's dtype. The scale is per row, so it
    multiplies the output columns after an integer-valued matmul."""
    return (torch.nn.functional.linear(x.float(), qweight.float()) * scales.float()).to(x.dtype)


def w4a16_matmul_ref(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                     group_size: int) -> torch.Tensor:
    weight = dequantize_int4(packed, scales, mins, group_size)
    return torch.nn.functional.linear(x.float(), weight).to(x.dtype)


def quantize_activations_ref(x: torch.Tensor, block: int = 32, passes: int = 1) -> torch.Tensor:
    """x [M, K] as the fused CPU step's narrow-weight kernels see it (kernels/cpu_decode.c): each
    block of 32 scaled to int8 by its largest magnitude, rounded half to even, then scaled back;
    with passes=2 (KAON_CPU_ACTIVATIONS=int8x2) plus the block's rounding remainder quantized the same way."""
    if passes == 2:
        first = quantize_activations_ref(x, block)
        return first + quantize_activations_ref(x.float() - first, block)
    rows = x.shape[0]
    blocks = x.float().reshape(rows, -1, block)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(blocks * inv) * (amax / 127.0)).reshape(rows, -1)
