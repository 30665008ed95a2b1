from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add that precedes it.

    weight_offset 1 is Gemma's variant: the checkpoint stores weight - 1, and the scaling
    happens in float32 before rounding (Llama rounds the normalised row first).
    """

    def __init__(self, hidden_size: int, eps: float, weight_offset: float = 0.0, kernel=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        self.weight_offset = weight_offset
        # A fused kernel (kernels.norm.rms_norm) for the plain norm, or for any with the GPU's batch-invariant
        # kernels (models/decoder._norm_kernel binds the offset), or None: torch's code.
        self.kernel = kernel

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.kernel is not None:
            return self.kernel(x, self.weight, self.eps, residual)
        if residual is not None:
            x = x + residual
            residual = x
        # Normalise in float32 whatever the model dtype, like the reference implementation.
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_offset:
            out = (normed * (self.weight_offset + self.weight.float())).to(x.dtype)
        else:
            out = self.weight * normed.to(x.dtype)
        return out if residual is None else (out, residual)
