"""Weight-only quantized matmuls on CPU that read the narrow weights directly.

torch ships CPU kernels for int8 and int4 weights (`_weight_int8pack_mm`,
`_weight_int4pack_mm_for_cpu`, the ones torchao's CPU weight-only paths call). Fed float32
activations they take a slow generic path, so the activations go in as bfloat16 and the
result comes back in x's dtype: the rounding that adds is of the order of the weights' own
quantization step. The references are in quant_gemm_ref.py (tests/unit/runtime/quant/test_quant.py compares).

int4 needs torch's own packed layout, so a weight is re-packed once (pack_int4_for_cpu):
torch's grid is w = (q - 8) * scale + zero, ours (GGUF Q4_1's) is w = q * scale + min, so
zero = min + 8 * scale, exact in float32.

Those kernels suit the few rows of a decode step, where reading the weight is the cost. A
prefill chunk's hundreds of rows are bound by arithmetic instead, and there they run at about
float32's speed (~140-160 GF/s on a 2-vCPU Zen 4). From DENSE_ROWS rows on, the weight is
widened once per call (a fraction of a millisecond) and the product is one dense GEMM: in
bfloat16 where the CPU multiplies it natively (AVX512-BF16, AMX), 340-420 GF/s on that machine,
else in float32 (bench/RESULTS.md, "Offline throughput"; its precision: "Quantization quality").
"""
from __future__ import annotations

import functools

import torch

from kaon_runtime.kernels.quant_gemm_ref import dequantize_int4, unpack_int4

ACTIVATION_DTYPE = torch.bfloat16
INT4_GROUP_SIZES = (32, 64, 128, 256)  # what torch's CPU int4 kernel takes
_INT4_ROW_MULTIPLE = 16  # its packing works on 16 output rows at a time
DENSE_ROWS = 128  # from here on the dense GEMM wins for both formats (int8 from ~16 rows, int4 from ~128)


@functools.cache
def dense_dtype() -> torch.dtype:
    """bfloat16 where the CPU has bfloat16 dot products, else float32 (torch would emulate bfloat16)."""
    native = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return torch.bfloat16 if any(getattr(torch.cpu, name, lambda: False)() for name in native) else torch.float32


def w8_dense_cpu(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """w8_matmul_cpu for many rows; scales float32 [N]. The int8 values are exact in bfloat16 (eight
    significant bits), so the product is integer-valued and the scale multiplies the output."""
    dtype = dense_dtype()
    return (torch.mm(x.to(dtype), qweight.to(dtype).t()).float() * scales).to(x.dtype)


def widen_int4(packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
               dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight dequantized to `dtype` [N, K]: in one pass by the C kernels where they are built
    (cpu_decode.widen_q4_1, the same bits), else by torch ops. Made on every prefill GEMM, so its cost is
    fixed per step: torch's five passes cost more than a 256-row GEMM (~20 ms vs ~6 ms per SmolLM2 layer,
    one thread), which made chunked prefill ~1.8-2.1x slower than one 1,024-row step (bench/prefill_steps.py)."""
    from kaon_runtime.kernels import cpu_decode  # on use: the library is built (or found cached) once

    lib = cpu_decode.library()
    if (lib is not None and packed.device.type == "cpu" and scales.dtype == mins.dtype == torch.float16
            and dtype in (torch.bfloat16, torch.float32)):
        return cpu_decode.widen_q4_1(lib, packed, scales, mins, group_size, dtype)
    return dequantize_int4(packed, scales, mins, group_size).to(dtype)


def w4_dense_cpu(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                 group_size: int) -> torch.Tensor:
    """x [M, K] @ dequant(weight).T for many rows, from kaon's int4 layout (any group size)."""
    dtype = dense_dtype()
    weight = widen_int4(packed, scales, mins, group_size, dtype)
    return torch.mm(x.to(dtype), weight.t()).to(x.dtype)


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
