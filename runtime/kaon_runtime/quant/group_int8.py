"""int8 weights with a float32 scale, and optionally a min, per group of 16 along K: w = q * scale + min.

The common shape of GGUF's 5-, 6- and 8-bit types and of Q2_K/Q3_K (quant/gguf.py repacks them
into it without changing a weight): their values fit int8 and their scales, sub-block scales
times a super-block scale, are exact in float32. Groups of 32 (Q8_0, Q5_x) repeat their scale.
On CPU few rows go through the fused kernels' Q8_G16 kind (kernels/cpu_decode.c: the scales
applied per half of each activation block), many rows through one dense GEMM on the widened
weight; elsewhere the weight is widened per call.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import DENSE_ROWS, dense_dtype
from kaon_runtime.quant.linear import QuantizedLinear, kernel_for

GROUP_SIZE = cpu_decode.G16


@dataclass(slots=True)
class GroupInt8Weight:
    qweight: torch.Tensor  # int8 [N, K]
    scales: torch.Tensor  # float32 [N, K / 16]
    mins: torch.Tensor | None  # float32 [N, K / 16], or None: symmetric


def dequantize_group_int8(weight: GroupInt8Weight) -> torch.Tensor:
    """float32 [N, K]: q * scale (+ min), one rounding per element as GGUF's own dequantizer does."""
    rows, k = weight.qweight.shape
    w = weight.qweight.float().reshape(rows, -1, GROUP_SIZE) * weight.scales[..., None]
    if weight.mins is not None:
        w = w + weight.mins[..., None]
    return w.reshape(rows, k)


def concat_rows(parts: list[GroupInt8Weight]) -> GroupInt8Weight:
    """Parts stacked along N (a fused q|k|v or gate|up); a part without mins gets zeros."""
    mins = None
    if any(p.mins is not None for p in parts):
        mins = torch.cat([p.mins if p.mins is not None else torch.zeros_like(p.scales) for p in parts])
    return GroupInt8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins)


class GroupInt8Linear(QuantizedLinear):
    qvalues: torch.Tensor  # buffers, declared for the type checker
    group_scales: torch.Tensor

    def __init__(self, weight: GroupInt8Weight, bias: torch.Tensor | None = None):
        rows, k = weight.qweight.shape
        if k % cpu_decode.QBLOCK or weight.scales.shape != (rows, k // GROUP_SIZE):
            raise ValueError(f"group int8: scales {tuple(weight.scales.shape)} do not fit a {rows} x {k} weight "
                             f"in groups of {GROUP_SIZE} (K a multiple of {cpu_decode.QBLOCK})")
        super().__init__(k, rows, bias)
        self.register_buffer("qvalues", weight.qweight)
        self.register_buffer("group_scales", weight.scales.float())
        self.group_mins: torch.Tensor | None
        self.register_buffer("group_mins", None if weight.mins is None else weight.mins.float())
        self._cpu_weights: cpu_decode.LinearWeights | None = None  # the kernel's interleaved copy, on first use

    @property
    def weight(self) -> GroupInt8Weight:
        return GroupInt8Weight(self.qvalues, self.group_scales, self.group_mins)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if kernel_for(x) == "cpu" and x.shape[0] >= DENSE_ROWS:
            dtype = dense_dtype()
            return torch.mm(x.to(dtype), dequantize_group_int8(self.weight).to(dtype).t()).to(x.dtype)
        if kernel_for(x) == "cpu" and cpu_decode.library() is not None:
            if self._cpu_weights is None:
                self._cpu_weights = cpu_decode.LinearWeights.q8_g16(self.qvalues, self.group_scales, self.group_mins)
            return cpu_decode.linear(self._cpu_weights, x).to(x.dtype)
        return torch.nn.functional.linear(x, dequantize_group_int8(self.weight).to(x.dtype))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={GROUP_SIZE}, mins={self.group_mins is not None}"
