"""Per-row quantizations of a large float tensor, a chunk of rows at a time.

int8 per row and int8 in groups along a row scale each row on its own, so quantizing a chunk of rows
gives exactly the rows the whole tensor would; only the temporaries (|w|, w / scale, its rounding: a
few float copies of what is being quantized) shrink to the chunk's size. For the vocabulary table,
the model's largest tensor (113 MB in float32 for SmolLM2), whole-tensor temporaries were the peak of
the whole load (issue 49 §3).
"""
from __future__ import annotations

import torch

from kaon_runtime.quant.group_int8 import GroupInt8Weight, dequantize_group_int8, quantize_group_int8
from kaon_runtime.quant.int8 import quantize_int8

CHUNK_ROWS = 4096


def quantize_int8_rows(weight: torch.Tensor, chunk: int = CHUNK_ROWS) -> tuple[torch.Tensor, torch.Tensor]:
    """quant/int8.py's quantize_int8, `chunk` rows at a time: the same int8 rows and scales."""
    qweight = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], chunk):
        q, s = quantize_int8(weight[start:start + chunk])
        qweight[start:start + chunk], scales[start:start + chunk] = q, s
    return qweight, scales


def quantize_group_int8_rows(weight: torch.Tensor, chunk: int = CHUNK_ROWS) -> GroupInt8Weight:
    """quant/group_int8.py's quantize_group_int8 (its default groups), `chunk` rows at a time, into tensors made
    once: a list of the chunks' results joined at the end held the table twice, and the chunks' float temporaries,
    freed between the kept chunks, stayed in the heap (the vocabulary table under --quantization peaked 165 MiB
    over the load for a 28 MiB result, issue 49 §3)."""
    first = quantize_group_int8(weight[:chunk])
    if weight.shape[0] <= chunk:
        return first
    qweight = torch.empty(weight.shape, dtype=first.qweight.dtype, device=weight.device)
    scales = torch.empty((weight.shape[0], *first.scales.shape[1:]), dtype=first.scales.dtype, device=weight.device)
    qweight[:chunk], scales[:chunk], group_size = first.qweight, first.scales, first.group_size
    del first
    for start in range(chunk, weight.shape[0], chunk):
        part = quantize_group_int8(weight[start:start + chunk])
        qweight[start:start + chunk], scales[start:start + chunk] = part.qweight, part.scales
    return GroupInt8Weight(qweight, scales, None, group_size)


def equal_after_group_int8(table: GroupInt8Weight, weight: torch.Tensor, chunk: int = CHUNK_ROWS) -> bool:
    """Whether `table` dequantizes to exactly `weight`, compared `chunk` rows at a time."""
    for start in range(0, weight.shape[0], chunk):
        rows = GroupInt8Weight(table.qweight[start:start + chunk], table.scales[start:start + chunk], None,
                               table.group_size)
        if not torch.equal(dequantize_group_int8(rows), weight[start:start + chunk]):
            return False
    return True
