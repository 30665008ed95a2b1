"""Weight-only quantized matmuls on CPU that read the narrow weights directly.

torch ships CPU kernels for int8 and int4 weights (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, the ones torchao's CPU weight-only paths call). Fed float32
activations they take a slow generic path, so the activations go in as bfloat16 and the
result comes back in x's dtype: the rounding that adds is of the order of the weights' own
quantization step. The references are in quant_gemm_ref.py (tests/test_quant.py compares).

int4 needs torch's own packed layout, so a weight is re-packed once (pack_int4_for_cpu):
torch's grid is w = (q - 8) * scale + zero, ours (GGUF Q4_1's) is w = q * scale + min, so
zero = min + 8 * scale, exact in float32.
"""
from __future__ import annotations

import torch

from kaon_runtime.kernels.quant_gemm_ref import unpack_int4

ACTIVATION_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel takes
_INT4_ROW_MULTIPLE = 16  # its packing works on 16 output rows at a time


def w8_matmul_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (qweight int8 [N, K] * scales [N]).T -> [M, N] in x's dtype; scales in ACTIVATION_DTYPE."""
    a = x.to(ACTIVATION_DTYPE).contiguous()
    return torch.ops.aten._weight_int8pack_mm(a, qweight, scales).to(x.dtype)


def int4_fits_cpu(out_features: int, group_size: int) -> bool:
    return out_features % _INT4_ROW_MULTIPLE == 0 and group_size in INT4_GROUP_SIZES


def pack_int4_for_cpu(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Our int4 layout -> (torch's packed weight, scales and zeros [K / group_size, N, 2])."""
    q = unpack_int4(packed, group_size).to(torch.int32)
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scale = scales.float()
    zero = mins.float() + 8 * scale
    scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
    return cpu_packed, scales_and_zeros


def w4_matmul_cpu(x: torch.Tensor, cpu_packed: torch.Tensor, scales_and_zeros: torch.Tensor,
                  group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(weight).T -> [M, N] in x's dtype, from pack_int4_for_cpu's output."""
    a = x.to(ACTIVATION_DTYPE).contiguous()
    return torch.ops.aten._weight_int4pack_mm_for_cpu(a, cpu_packed, group_size, scales_and_zeros).to(x.dtype)
