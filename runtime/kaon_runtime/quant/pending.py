"""A linear's place held, without its weight, until a quantized weight is installed in it.

Swapped in on the meta device before a model's memory is allocated, for every linear whose weight
comes quantized from the checkpoint (a publisher's AWQ / GPTQ / compressed-tensors layers,
engine/prequantized.py; a GGUF file's own blocks, engine/gguf_weights.py): no float copy of those
weights is ever allocated, so loading peaks near the quantized model's size (issue 49 §3).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn


class PendingLinear(nn.Module):
    """Holds a linear's place (and its float bias) until its quantized weight is installed."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a quantized linear was never installed")


def hold_places(model: nn.Module, names: set[str]) -> None:
    """Swap each nn.Linear of `model` named in `names` for a PendingLinear (call on meta)."""
    modules = dict(model.named_modules())
    for name in names:
        linear = modules.get(name)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"{name} is not a linear layer of the model")
        parent, _, child = name.rpartition(".")
        setattr(modules[parent], child, PendingLinear(linear))


def hold_table(head: Any, lookup_dtype: torch.dtype) -> None:
    """Drop a tied vocabulary head's float table before it is allocated (call on meta): its int8 table comes
    from the checkpoint as it is (a GGUF's Q8_0 blocks), and serves the token lookup too (quant/surgery.py)."""
    head.lookup_dtype = lookup_dtype
    head.register_parameter("weight_t", None)
