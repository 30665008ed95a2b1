"""nn.Linear through the batch-invariant GEMM (kernels/invariant_gemm.py), for the GPU's batch-invariant
kernels (layers/kernel_backend.py `batch_invariant`, KAON_GPU_BATCH_INVARIANT=1; issue 49 §2).

A subclass, so that everything that finds a model's linears by type still finds these: checkpoint loading,
quantization (quant/surgery.py swaps them for quantized twins, which quant/invariant.py then marks), LoRA
(which wraps them). Only the product changes: F.linear's cuBLAS picks its kernel and split-K by the row count,
this GEMM by the weight's shape alone, so a row's output does not move with the rows beside it.
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.layers.kernel_backend import KernelBackend
from kaon_runtime.layers.rows_alone import RowsAloneLinear


class InvariantLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from kaon_runtime.kernels import invariant_gemm  # on use: CPU-only torch builds lack Triton
        out = invariant_gemm.linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


def linear_class(kernels: KernelBackend) -> type[nn.Linear]:
    """The projections' class for a model built with `kernels` (a float64 model on CPU: layers/rows_alone.py's)."""
    if kernels.cpu_rows_alone:
        return RowsAloneLinear
    return InvariantLinear if kernels.batch_invariant else nn.Linear
