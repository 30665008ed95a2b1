"""Float32 linear layers on CPU through oneDNN, their weights reordered once at load.

torch's default CPU GEMM (MKL) is quick for one row and slow for a few, and a decode step is
exactly a few rows; oneDNN with the weight reordered once into its blocked layout (the path
torch.compile's CPU freezing takes) costs about as much for a few rows as for one. Prefill
chunks of ~1,000 rows run somewhat slower, a trade decode-heavy serving wins (docs/engine.md
has the measurements). The sums run in another order than F.linear's, so outputs differ by
float32 rounding.
"""
from __future__ import annotations

import os

import torch
from torch import nn


def onednn_linears_apply(device: torch.device, dtype: torch.dtype) -> bool:
    """On for float32 on CPU where torch has oneDNN; KAON_CPU_LINEAR=torch turns it off."""
    choice = os.environ.get("KAON_CPU_LINEAR", "onednn")
    if choice not in ("onednn", "torch"):
        raise ValueError(f"KAON_CPU_LINEAR must be onednn or torch, got {choice!r}")
    return (choice == "onednn" and device.type == "cpu" and dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class OneDnnLinear(nn.Module):
    """Stands in for an nn.Linear; holds only the reordered weight (an opaque oneDNN tensor)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
        self.bias = linear.bias

    @property
    def weight(self) -> torch.Tensor:
        """The plain [out, in] weight, converted back on each read (for inspection, not for the forward)."""
        return self.packed_weight.to_dense()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


@torch.no_grad()
def use_onednn_linears(model: nn.Module) -> int:
    """Swap every nn.Linear of `model` for an OneDnnLinear, in place; return how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, OneDnnLinear(child))
                swapped += 1
    return swapped
