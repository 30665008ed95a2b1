"""Batched LoRA on a projection: y = base(x) + (x @ A[slot].T) @ B[slot] for each token's adapter slot.

A LoraLinear wraps a projection after its weights are loaded (and quantized: the base may be any
linear module) and holds a fixed pool of slots, one adapter each, rank padded with zeros to the
pool's max rank R. A fused projection (q|k|v, gate|up) has P parts, each with its own A and B:
a slot stacks the parts' A along the rank, A [S, P*R, in], and their B block-diagonally,
B [S, P*R, out] (part i's rows add only into its own columns), so one adapter on a fused
projection is two matmuls. Every LoraLinear of a model reads the same LoraBatch, which the
runner sets before each step: which slot each token uses (-1: the base model).

On CUDA the Triton kernels (kernels.lora) take every token in one launch per part, whatever the
mix of adapters; elsewhere the tokens are grouped by slot (the runner does it once per step),
two matmuls and one scatter-add per adapter in the step. On CPU the fused C step usually runs instead
(models/fused_weights.lora_slots): it reads the slots in place, in the model's dtype, each row alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(slots=True)
class LoraBatch:
    """One step's adapters, shared by every LoraLinear of the model; empty: no token has one."""

    slots: torch.Tensor | None = None  # [T] long, -1 for base tokens
    groups: list[tuple[int, torch.Tensor | None]] = field(default_factory=list)  # slot, its rows (None: all)

    @property
    def active(self) -> bool:
        return self.slots is not None

    def set(self, token_slots: list[int] | None, device: torch.device) -> None:
        """Group this step's tokens by slot; None or all -1 clears the batch."""
        if not token_slots or max(token_slots) < 0:
            self.slots, self.groups = None, []
            return
        self.slots = torch.tensor(token_slots, dtype=torch.long, device=device)
        rows: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                rows.setdefault(slot, []).append(row)
        whole = len(rows) == 1 and len(next(iter(rows.values()))) == len(token_slots)
        self.groups = [(slot, None if whole else torch.tensor(r, dtype=torch.long, device=device))
                       for slot, r in rows.items()]


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, fan_in: int, parts: list[int], num_slots: int, max_rank: int,
                 batch: LoraBatch, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.base, self.batch = base, batch
        self.parts, self.rank = parts, max_rank
        self.offsets = [sum(parts[:i]) for i in range(len(parts))]
        # Plain attributes, not buffers: the slots are no part of the model's weights or state dict.
        self.a = torch.zeros(num_slots, len(parts) * max_rank, fan_in, dtype=dtype, device=device)
        self.b = torch.zeros(num_slots, len(parts) * max_rank, sum(parts), dtype=dtype, device=device)
        # Each slot's rank on each part (0: its adapter leaves the part alone): the fused CPU step
        # (kernels/cpu_decode.c) reads it to skip the padding.
        self.ranks = torch.zeros(num_slots, len(parts), dtype=torch.int32)

    @torch.no_grad()
    def load_slot(self, slot: int, part: int, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        """Put one part's A [r, in] and B [out, r] in a slot (None: the adapter leaves this part alone)."""
        ranks = slice(part * self.rank, (part + 1) * self.rank)
        self.a[slot, ranks].zero_()
        self.b[slot, ranks].zero_()
        self.ranks[slot, part] = 0 if a is None or b is None else a.shape[0]
        if a is not None and b is not None:
            rank, offset = a.shape[0], self.offsets[part]
            self.a[slot, part * self.rank:part * self.rank + rank].copy_(a)
            self.b[slot, part * self.rank:part * self.rank + rank, offset:offset + self.parts[part]].copy_(b.T)

    def part_weights(self, part: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One part's A [S, R, in] and B [S, R, out_part]: views of the slots, as kernels.lora takes them."""
        ranks, offset = slice(part * self.rank, (part + 1) * self.rank), self.offsets[part]
        return self.a[:, ranks], self.b[:, ranks, offset:offset + self.parts[part]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.batch
        if batch.slots is None:
            return y
        if x.is_cuda:
            from kaon_runtime.kernels.lora import lora_expand, lora_shrink  # CPU-only torch builds lack Triton
            for part, (offset, size) in enumerate(zip(self.offsets, self.parts)):
                a, b = self.part_weights(part)
                lora_expand(y[:, offset:offset + size], lora_shrink(x, a, batch.slots), b, batch.slots)
            return y
        for slot, rows in batch.groups:
            if rows is None:
                y += (x @ self.a[slot].T) @ self.b[slot]
            else:
                y.index_add_(0, rows, (x[rows] @ self.a[slot].T) @ self.b[slot])
        return y
