"""Pure-torch reference of the batched LoRA kernels (kernels.lora): one adapter slot per token, gathered.

Slots hold every adapter's weights in one stacked tensor, rank padded with zeros to the pool's
max rank: A [S, R, in] and B [S, R, out] (the scaling folded into B; both row-major in their
last dimension, as x and y are). A token's slot -1 is the base model: it gets nothing added.
"""
from __future__ import annotations

import torch


def lora_shrink_ref(x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """x [T, in] -> [T, R]: each token's x @ A[slot].T, zeros for slot -1; computed in float32."""
    out = torch.zeros(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)
    rows = slots >= 0
    out[rows] = torch.einsum("ti,tri->tr", x[rows].float(), a[slots[rows]].float())
    return out


def lora_expand_ref(y: torch.Tensor, shrunk: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """y [T, out] += shrunk [T, R] @ B[slot] for each token with a slot, in place."""
    rows = slots >= 0
    added = torch.einsum("tr,tro->to", shrunk[rows].float(), b[slots[rows]].float())
    y[rows] = (y[rows].float() + added).to(y.dtype)
