"""8-bit weights with a scale and an offset per group along K: w = q * scale + min (W8A16).

What GPTQ's 8-bit checkpoints with groups or zero points, and compressed-tensors' grouped
W8A16, hold; kaon's Int8Linear keeps one symmetric scale per row and takes the rest. The
weight stays 8-bit in memory; each matmul widens it (no kernel reads groups of int8 yet).
"""
from __future__ import annotations

import torch

from kaon_runtime.quant.linear import QuantizedLinear


def dequantize_grouped_int8(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                            group_size: int) -> torch.Tensor:
    rows = qweight.shape[0]
    q = qweight.float().reshape(rows, -1, group_size)
    return (q * scales.float()[..., None] + mins.float()[..., None]).reshape(rows, -1)


class GroupedInt8Linear(QuantizedLinear):
    qweight: torch.Tensor  # buffers (register_buffer), declared for the type checker
    scales: torch.Tensor
    mins: torch.Tensor

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group_size: int,
                 bias: torch.Tensor | None = None):
        super().__init__(qweight.shape[1], qweight.shape[0], bias)
        self.group_size = group_size
        self.register_buffer("qweight", qweight)  # int8 [N, K]
        self.register_buffer("scales", scales)  # [N, K / group_size]
        self.register_buffer("mins", mins)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        weight = dequantize_grouped_int8(self.qweight, self.scales, self.mins, self.group_size)
        compute = torch.float32 if x.device.type == "cpu" else x.dtype
        return torch.nn.functional.linear(x.to(compute), weight.to(compute)).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, group_size={self.group_size}"
