"""Dynamic per-token int8 activations (compressed-tensors `int-quantized` W8A8, `input_activations`
with `dynamic: true`, `strategy: token`): each row of a linear's input is quantized at run time as
the compressed-tensors spec does it, and multiplied with the int8 weight in integers.

Per token (row) x: scale = max |x| / 127.5 (symmetric: half of int8's range of 255; a zero row
takes float32's eps), q = clamp(round(x / scale), -128, 127), rounded half to even. The product
is int8 x int8 summed in int32 (torch._int_mm, exact), then scaled by the row's and the output
channel's scales in float32: out = acc * scale_x * scale_w. The integer sum is exact, so the result
equals `w8a8_reference` bit for bit; against float arithmetic on the dequantized values
(transformers' fake quantization) it differs by float rounding only.

On CPU the fused C step reads these layers as its kind INT8_A8 (kernels/cpu_decode.c): the same
per-token quantization and exact int32 sums, each row's own, so the same numbers bit for bit whatever
the step's row count (issue 49 §2). `--dtype float32` (the reference mode) runs this module's torch ops.
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.linear import ChannelScaledLinear

_HALF_RANGE = 127.5  # (127 - -128) / 2: the spec's symmetric int8 scale divides max |x| by this


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (int8 [M, K], float32 scales [M, 1]) as compressed-tensors' dynamic token quantization."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / _HALF_RANGE
    scale = torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)
    return torch.round((x / scale).clamp(-128, 127)).to(torch.int8), scale


def int8_matmul(q: torch.Tensor, qweight: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] @ int8 [N, K].T -> int32 [M, N], exact, through torch._int_mm (its CUDA kernel wants
    more than 16 rows: fewer are padded with zero rows)."""
    rows = q.shape[0]
    if q.is_cuda and rows <= 16:
        q = torch.cat([q, q.new_zeros(17 - rows, q.shape[1])])
    return torch._int_mm(q.contiguous(), qweight.t())[:rows]


def w8a8_reference(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The same per-token quantization and product in plain torch ops (int64 sums), float32 out."""
    q, row_scales = quantize_per_token(x)
    acc = q.to(torch.int64) @ qweight.to(torch.int64).t()
    return acc.to(torch.int32).float() * row_scales * scales.float()


class DynamicInt8Linear(ChannelScaledLinear):
    """int8 weights, one float32 scale per output channel, and int8 inputs quantized per token at run time."""

    @classmethod
    def from_int8(cls, inner: nn.Module) -> DynamicInt8Linear:
        """The same weight (a per-channel int8 linear's), its inputs now quantized per token."""
        if not isinstance(inner, ChannelScaledLinear) or inner.qweight.dtype != torch.int8:
            raise ValueError(f"dynamic int8 activations need per-channel int8 weights, got {type(inner).__name__}")
        return cls(inner.qweight, inner.scales.float().reshape(-1), inner.bias)

    def fused_cpu_weights(self) -> cpu_decode.LinearWeights:
        """The fused CPU step's INT8_A8 kind, the weight read in place: the numbers of `matmul` below."""
        return cpu_decode.LinearWeights.int8_a8(self.qweight, self.scales, self.bias)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        q, row_scales = quantize_per_token(x)
        return (int8_matmul(q, self.qweight).float() * row_scales * self.scales).to(x.dtype)
