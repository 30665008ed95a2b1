"""GGUF Q4_1 blocks -> Int4Weight, bit for bit.

A Q4_1 block is 20 bytes: float16 scale d, float16 min m, then 16 bytes holding 32 4-bit
values q (byte j: element j in the low nibble, element j + 16 in the high one), w = d * q + m.
That is Int4Weight's layout with group_size 32, so only the fields are split apart.
"""
from __future__ import annotations

import torch

from kaon_runtime.quant.int4 import Int4Weight

Q4_1_GROUP = 32
_BLOCK_BYTES = 20


def int4_from_q4_1(blocks: torch.Tensor) -> Int4Weight:
    """uint8 [N, K / 32, 20] -> Int4Weight with group_size 32."""
    assert blocks.dtype == torch.uint8 and blocks.dim() == 3 and blocks.shape[2] == _BLOCK_BYTES, \
        f"Q4_1 blocks must be uint8 [rows, blocks, {_BLOCK_BYTES}], got {blocks.dtype} {tuple(blocks.shape)}"
    rows = blocks.shape[0]
    scales = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1)
    packed = blocks[..., 4:].reshape(rows, -1)
    return Int4Weight(packed, scales.contiguous(), mins.contiguous(), Q4_1_GROUP)
