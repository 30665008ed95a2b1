"""4-bit weights in groups along K, each with a scale and a min: w = q * scale + min (W4A16).

The layout is GGUF Q4_1's when group_size is 32 (see kernels/quant_gemm_ref.py), so a Q4_1
checkpoint's blocks become an Int4Weight as they are (quant/gguf.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import (
    DENSE_ROWS,
    int4_fits_cpu,
    pack_int4_for_cpu,
    w4_dense_cpu,
    w4_matmul_cpu,
)
from kaon_runtime.kernels.quant_gemm_ref import pack_int4, w4a16_matmul_ref
from kaon_runtime.quant import kernel_layout
from kaon_runtime.quant.linear import QuantizedLinear, kernel_for

DEFAULT_GROUP_SIZE = 32
_QMAX = 15


@dataclass(slots=True)
class Int4Weight:
    packed: torch.Tensor  # uint8 [N, K / 2]
    scales: torch.Tensor  # float16 [N, K / group_size]
    mins: torch.Tensor  # float16 [N, K / group_size]
    group_size: int
    # The inputs' true width where K above was padded to whole groups (quantize_int4's pad); None: K
    in_features: int | None = None


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE, pad: bool = False) -> Int4Weight:
    """Asymmetric min/max quantization per group; scales and mins are stored as float16 like Q4_1's. pad: a K that
    is not whole groups gets columns up to the next group, copies of the row's last weight, so that the last group's
    range (and so every true weight's value) is its true columns' alone; Int4Linear feeds them zero inputs."""
    rows, k = weight.shape
    if k % group_size and pad:
        weight = torch.cat([weight, weight[:, -1:].expand(rows, -k % group_size)], dim=1)
        padded = quantize_int4(weight, group_size)
        padded.in_features = k
        return padded
    if k % group_size:
        raise ValueError(f"int4: in_features {k} is not a multiple of the group size {group_size}")
    w = weight.float().reshape(rows, -1, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scales, mins = ((high - low) / _QMAX).half(), low.half()
    if not torch.isfinite(scales).all():
        raise ValueError("int4: a weight group spans more than float16 can hold")
    # Round against the float16 values that will be stored, so dequantization sees the same grid.
    step = scales.float().clamp(min=torch.finfo(torch.float16).tiny)[..., None]
    q = torch.round((w - mins.float()[..., None]) / step).clamp(0, _QMAX).to(torch.uint8)
    return Int4Weight(pack_int4(q.reshape(rows, k), group_size), scales, mins, group_size)


class Int4Linear(QuantizedLinear):
    packed: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, weight: Int4Weight, bias: torch.Tensor | None = None):
        super().__init__(weight.in_features or weight.packed.shape[1] * 2, weight.packed.shape[0], bias)
        self.padded_features = weight.packed.shape[1] * 2  # the packed K: in_features, or whole groups past it
        self.group_size = weight.group_size
        self.register_buffer("packed", weight.packed)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("mins", weight.mins)
        self._cpu_weight: tuple[torch.Tensor, torch.Tensor] | None = None  # torch's CPU layout, made on first use

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        # (a K that is not whole groups: padded, see quantize_int4; the fused CPU step then reads it at any width)
        return cls(quantize_int4(linear.weight.detach(), group_size, pad=True), linear.bias)

    # The fused CPU step's interleaved copy, once the module holds only that (quant/kernel_layout.py); None: its own
    kernel_weights: cpu_decode.LinearWeights | None = None

    def hold_kernel_layout(self) -> cpu_decode.LinearWeights | None:
        """Keep only the fused CPU step's interleaved copy (LinearWeights.q4_1, or q4_f32 for float32 scales),
        where the step can read it: groups of 32."""
        if (self.kernel_weights is None and self.group_size == cpu_decode.QBLOCK
                and kernel_layout.can_hold(self, self.packed)):
            f32 = self.scales.dtype == torch.float32  # (GPTQ / AWQ / compressed-tensors' exact float32 scales)
            make = cpu_decode.LinearWeights.q4_f32 if f32 else cpu_decode.LinearWeights.q4_1
            held = make(self.packed, self.scales, self.mins, self.bias).with_true_width(self.in_features)
            self._cpu_weight = None
            kernel_layout.hold(self, held, drop=("packed", "scales", "mins"))
        return self.kernel_weights

    def int4_weight(self) -> Int4Weight:
        """The weight in kaon's int4 layout: its own tensors, or rebuilt from the held copy (groups of 32)."""
        true_width = self.in_features if self.in_features != self.padded_features else None
        if self.kernel_weights is None:
            return Int4Weight(self.packed, self.scales, self.mins, self.group_size, true_width)
        return Int4Weight(*cpu_decode.plain_q4(self.kernel_weights), self.group_size, true_width)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] != self.padded_features:  # zero inputs for the padding columns: each adds an exact 0
            x = torch.nn.functional.pad(x, (0, self.padded_features - x.shape[1]))
        kernel = kernel_for(x, self.reference)
        if self.kernel_weights is not None:  # held in the C step's layout only (CPU)
            plain = (*cpu_decode.plain_q4(self.kernel_weights), self.group_size)
            return kernel_layout.matmul(x, kernel, lambda x: w4_dense_cpu(x, *plain), lambda x: w4_dense_cpu(x, *plain),
                                        lambda x: w4a16_matmul_ref(x, *plain))
        if kernel == "triton" and self.batch_invariant:  # one tile for every M (quant/invariant.py)
            from kaon_runtime.kernels import invariant_gemm
            return invariant_gemm.w4a16_linear(x, self.packed, self.scales, self.mins, self.group_size)
        if kernel == "triton":  # on use: CPU-only torch builds lack Triton
            from kaon_runtime.kernels import quant_gemv
            from kaon_runtime.kernels.quant_gemm import w4a16_matmul
            if quant_gemv.fits(x, "int4"):
                return quant_gemv.w4a16_gemv(x, self.packed, self.scales, self.mins, self.group_size)
            return w4a16_matmul(x, self.packed, self.scales, self.mins, self.group_size)
        if kernel == "cpu" and x.shape[0] >= DENSE_ROWS:
            return w4_dense_cpu(x, self.packed, self.scales, self.mins, self.group_size)
        if kernel == "cpu" and int4_fits_cpu(self.out_features, self.group_size):
            if self._cpu_weight is None:
                # A second copy of the 4-bit weight, in torch's layout; the Q4_1 one stays the state.
                self._cpu_weight = pack_int4_for_cpu(self.packed, self.scales, self.mins, self.group_size)
            return w4_matmul_cpu(x, *self._cpu_weight, self.group_size)
        return w4a16_matmul_ref(x, self.packed, self.scales, self.mins, self.group_size)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"
