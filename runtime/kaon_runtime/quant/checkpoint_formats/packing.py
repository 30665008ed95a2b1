"""Integers packed into int32 words, as the checkpoint formats store them.

Every format here packs 32 / bits values per word, value i at bits [i * bits, (i + 1) * bits);
they differ in the axis they pack along and, for AutoAWQ, in the order of the columns inside a word.
"""
from __future__ import annotations

import torch

# AutoAWQ GEMM puts column order[i] of each run of eight in nibble i.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their unsigned `bits`-bit values as int32, the packed axis `dim` grown 32 / bits times."""
    per_word = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    words = packed.to(torch.int32).movedim(dim, -1).unsqueeze(-1)
    values = (words >> shifts) & ((1 << bits) - 1)  # >> on int32 is arithmetic: the mask drops the sign bits
    return values.flatten(-2).movedim(-1, dim) if per_word > 1 else values.squeeze(-1).movedim(-1, dim)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's int32 [rows, cols / 8] -> 4-bit values int32 [rows, cols] in column order."""
    nibbles = unpack_int32(packed, 4, dim=1).reshape(packed.shape[0], -1, 8)
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return nibbles[..., inverse].reshape(packed.shape[0], -1)
