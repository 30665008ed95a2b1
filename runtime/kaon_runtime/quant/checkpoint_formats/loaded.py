"""One linear's weight as a checkpoint gave it, in one of kaon's own layouts, and the module that runs it.

Every field keeps output channels as rows (block-scaled FP8's scales: one row per block of rows),
so fusing q|k|v or gate|up is a concatenation of rows and a tensor-parallel shard is a slice of
rows or of whole groups of columns, as for float weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from kaon_runtime.errors import ModelDoesNotFitError
from kaon_runtime.kernels.cpu_decode import QBLOCK
from kaon_runtime.kernels.quant_gemm_ref import pack_int4, unpack_int4
from kaon_runtime.quant.fp8 import Fp8Linear
from kaon_runtime.quant.fp8_block import Fp8BlockLinear
from kaon_runtime.quant.group_int8 import GroupInt8Linear, GroupInt8Weight
from kaon_runtime.quant.int4 import Int4Linear, Int4Weight
from kaon_runtime.quant.int8 import Int8Linear

# Per kind, each field's (rows per stored row, columns per stored column; None: one value per row).
_FIELDS: dict[str, dict[str, tuple[str, str | None]]] = {
    "int4": {"packed": ("1", "2"), "scales": ("1", "group"), "mins": ("1", "group")},
    "int8": {"qweight": ("1", "1"), "scales": ("1", None)},
    "int8_grouped": {"qweight": ("1", "1"), "scales": ("1", "group"), "mins": ("1", "group")},
    "fp8": {"qweight": ("1", "1"), "scales": ("1", None)},
    "fp8_block": {"qweight": ("1", "1"), "scales": ("block_rows", "group")},
}


@dataclass(slots=True)
class LoadedWeight:
    kind: str  # a key of _FIELDS
    tensors: dict[str, torch.Tensor]
    group_size: int  # columns per scale (FP8 blocks: the block's width)
    block_rows: int = 1  # FP8 blocks: the block's height
    perm: torch.Tensor | None = None  # act-order: the input columns in the order the weight's columns are stored
    name: str = field(default="")  # the checkpoint's module, for error messages

    @property
    def out_features(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def _step(self, spec: str) -> int:
        return {"1": 1, "2": 2, "group": self.group_size, "block_rows": self.block_rows}[spec]

    def select(self, rows: tuple[int, int], cols: tuple[int, int]) -> LoadedWeight:
        """The shard [start, start + length) of rows and of input columns (whole groups only)."""
        sliced = {}
        for key, tensor in self.tensors.items():
            row_spec, col_spec = _FIELDS[self.kind][key]
            tensor = tensor.narrow(0, *self._whole(rows, self._step(row_spec), key, "rows"))
            if col_spec is not None:
                tensor = tensor.narrow(1, *self._whole(cols, self._step(col_spec), key, "columns"))
            sliced[key] = tensor
        return LoadedWeight(self.kind, sliced, self.group_size, self.block_rows, self.perm, self.name)

    def _whole(self, span: tuple[int, int], step: int, key: str, axis: str) -> tuple[int, int]:
        start, length = span
        if start % step or length % step:
            raise ModelDoesNotFitError(f"{self.name}.{key}: a tensor-parallel shard of {axis} "
                                       f"[{start}, {start + length}) splits a quantization group of {step}; "
                                       "choose a tensor_parallel_size that keeps groups whole")
        return start // step, length // step

    def to_module(self, bias: torch.Tensor | None, device: torch.device) -> nn.Module:
        t = {key: tensor.to(device).contiguous() for key, tensor in self.tensors.items()}
        module: nn.Module
        if self.kind == "int4":
            weight = Int4Weight(t["packed"], t["scales"], t["mins"], self.group_size)
            module = Int4Linear(_groups_of_32(weight) if device.type == "cpu" else weight, bias)
        elif self.kind == "int8":
            module = Int8Linear(t["qweight"], t["scales"], bias)
        elif self.kind == "int8_grouped":
            module = GroupInt8Linear(GroupInt8Weight(t["qweight"], t["scales"], t["mins"], self.group_size), bias)
        elif self.kind == "fp8":
            module = Fp8Linear(t["qweight"], t["scales"], bias)
        else:
            module = Fp8BlockLinear(t["qweight"], t["scales"], (self.block_rows, self.group_size), bias)
        return module if self.perm is None else InputPermutedLinear(module, self.perm.to(device))


def _groups_of_32(weight: Int4Weight) -> Int4Weight:
    """Wider int4 groups as groups of 32, their scale and offset repeated: the fused CPU step reads only
    those (a quarter more memory for groups of 128, for its speed); the values are the same."""
    size = weight.group_size
    k = weight.packed.shape[1] * 2
    if size == k and size % QBLOCK:  # one group per row (per channel) at a K that is not whole blocks: padded to
        q = unpack_int4(weight.packed, size)  # them, zero inputs for the padding (Int4Linear); the values the same
        q = torch.nn.functional.pad(q, (0, -k % QBLOCK))
        repeat = q.shape[1] // QBLOCK
        return Int4Weight(pack_int4(q, QBLOCK), weight.scales.repeat_interleave(repeat, 1),
                          weight.mins.repeat_interleave(repeat, 1), QBLOCK, k)
    if size <= QBLOCK or size % QBLOCK:
        return weight
    q = unpack_int4(weight.packed, size)
    repeat = size // QBLOCK
    return Int4Weight(pack_int4(q, QBLOCK), weight.scales.repeat_interleave(repeat, 1),
                      weight.mins.repeat_interleave(repeat, 1), QBLOCK)


def concat_rows(parts: list[LoadedWeight], name: str) -> LoadedWeight:
    """q|k|v or gate|up as one weight, the parts' rows stacked in order."""
    first = parts[0]
    for part in parts[1:]:
        if (part.kind, part.group_size, part.block_rows) != (first.kind, first.group_size, first.block_rows):
            raise ValueError(f"{name}: its parts are quantized differently ({first.name}: {first.kind}, "
                             f"groups of {first.group_size}; {part.name}: {part.kind}, groups of {part.group_size})")
        if (part.perm is None) != (first.perm is None) or (part.perm is not None and first.perm is not None
                                                           and not torch.equal(part.perm, first.perm)):
            raise ValueError(f"{name}: its parts {first.name} and {part.name} have different act-order g_idx")
        if part.block_rows > 1 and part.out_features % part.block_rows:
            raise ValueError(f"{part.name}: {part.out_features} rows are not whole blocks of {part.block_rows}")
    tensors = {key: torch.cat([p.tensors[key] for p in parts]) for key in first.tensors}
    return LoadedWeight(first.kind, tensors, first.group_size, first.block_rows, first.perm, name)


class InputPermutedLinear(nn.Module):
    """A linear whose stored input columns are a permutation of x's (GPTQ act-order, sorted into whole
    groups once at load): x is gathered into that order first."""

    perm: torch.Tensor  # a buffer, declared for the type checker

    def __init__(self, inner: nn.Module, perm: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.in_features, self.out_features = perm.numel(), inner.out_features  # as an nn.Linear's (LoRA reads them)
        self.register_buffer("perm", perm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x.index_select(-1, self.perm))


def grouped_weight(name: str, q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int,
                   g_idx: torch.Tensor | None = None) -> LoadedWeight:
    """An integer checkpoint's weight w = (q - zero) * scale, q unsigned `bits`-bit [N, K], scales and zeros
    [N, groups] (zeros unsigned, e.g. 8 for symmetric 4-bit), in kaon's layout (w = q * scale + min).

    g_idx (act-order) names each input column's group; the columns are sorted into whole groups once here."""
    n, k = q.shape
    groups = scales.shape[1]
    if scales.shape[0] != n or zeros.shape != scales.shape:
        raise ValueError(f"{name}: scales {tuple(scales.shape)} and zero points {tuple(zeros.shape)} "
                         f"do not fit a {n} x {k} weight")
    if k % groups:
        raise ValueError(f"{name}: {groups} groups do not divide its {k} input columns")
    group_size = k // groups
    perm = None
    if g_idx is not None:
        perm = _act_order(name, g_idx, k, group_size, groups)
        if perm is not None:
            q = q[:, perm]
    # float32 offsets: -zero * scale is exact there for float16 / bfloat16 scales; float32 scales beside
    # them, so the fused CPU step reads both as they are (its Q4_F32 kind) instead of rounding to float16.
    scale = scales.float()
    mins = -zeros.float() * scale
    if bits == 4:
        if group_size == k:  # one scale per row: kernels take groups, so repeat it over groups of 128 (or 32)
            group_size = 128 if k % 128 == 0 else 32 if k % 32 == 0 else k
            scale = scale.repeat_interleave(k // group_size, 1)
            mins = mins.repeat_interleave(k // group_size, 1)
        if group_size % 2:
            raise ValueError(f"{name}: 4-bit groups of {group_size} columns do not pack into bytes")
        packed = pack_int4(q.to(torch.uint8), group_size)
        return LoadedWeight("int4", {"packed": packed, "scales": scale.contiguous(), "mins": mins.contiguous()},
                            group_size, perm=perm, name=name)
    if bits != 8:
        raise ValueError(f"{name}: {bits}-bit weights are not supported (4 and 8 are)")
    qweight = (q - 128).to(torch.int8)  # w = (q - 128) * scale + (128 - zero) * scale
    if groups == 1 and bool((zeros == 128).all()):
        return LoadedWeight("int8", {"qweight": qweight, "scales": scales.float().reshape(n)}, k, perm=perm,
                            name=name)
    mins = (128 - zeros.float()) * scales.float()
    return LoadedWeight("int8_grouped", {"qweight": qweight, "scales": scales.float(), "mins": mins}, group_size,
                        perm=perm, name=name)


def _act_order(name: str, g_idx: torch.Tensor, k: int, group_size: int, groups: int) -> torch.Tensor | None:
    """The column order that makes g_idx's groups contiguous, or None when they already are."""
    if g_idx.dim() != 1 or g_idx.numel() != k:
        raise ValueError(f"{name}.g_idx has shape {tuple(g_idx.shape)}, the layer has {k} input columns")
    g_idx = g_idx.long()
    if g_idx.min() < 0 or g_idx.max() >= groups:
        raise ValueError(f"{name}.g_idx names groups outside 0..{groups - 1}")
    if not bool((torch.bincount(g_idx, minlength=groups) == group_size).all()):
        raise ValueError(f"{name}.g_idx does not give every group {group_size} columns")
    perm = torch.argsort(g_idx, stable=True)
    return None if torch.equal(perm, torch.arange(k)) else perm
