"""GPTQ checkpoints as AutoGPTQ / GPTQModel write them, and AutoAWQ's GEMM checkpoints.

GPTQ: `qweight` int32 [K * bits / 32, N], packed along the input rows (value i of a word at bits
i * bits); `qzeros` int32 [groups, N * bits / 32], packed along the outputs; `scales` [groups, N];
`g_idx` [K] (each input row's group; act-order when it is not sorted). w = (q - zero) * scale,
where the "gptq" checkpoint format stores zero - 1 (AutoGPTQ's old off-by-one) and "gptq_v2" the zero.

AWQ (GEMM): `qweight` int32 [K, N / 8] packed along the outputs, a word's eight columns in the
order AWQ_ORDER; `qzeros` int32 [groups, N / 8] likewise; `scales` [groups, N]; 4-bit only, no g_idx.
"""
from __future__ import annotations

import torch

from kaon_runtime.errors import ModelLoadError
from kaon_runtime.quant.checkpoint_formats.loaded import LoadedWeight, grouped_weight
from kaon_runtime.quant.checkpoint_formats.packing import unpack_awq, unpack_int32
from kaon_runtime.quant.checkpoint_formats.scheme import CheckpointScheme

_MARKERS = frozenset({"qweight"})
_SUFFIXES = frozenset({"qweight", "qzeros", "scales", "g_idx"})


def gptq_scheme(config: dict) -> CheckpointScheme:
    bits = int(config.get("bits", 4))
    group_size = int(config.get("group_size", 128))
    if bits not in (4, 8):
        raise ModelLoadError(f"GPTQ with {bits}-bit weights is not supported (4 and 8 are)")
    checkpoint_format = config.get("checkpoint_format", "gptq")
    if checkpoint_format not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint_format {checkpoint_format!r} is not supported (gptq, gptq_v2 are)")
    zero_offset = 1 if checkpoint_format == "gptq" else 0
    act_order = bool(config.get("desc_act"))

    def convert(name: str, t: dict[str, torch.Tensor], k: int) -> LoadedWeight:
        qweight, qzeros, scales = (_need(name, t, s) for s in ("qweight", "qzeros", "scales"))
        per_word = 32 // bits
        n = qweight.shape[1] if qweight.dim() == 2 else 0
        _check(name, "qweight", qweight, (k // per_word, n))
        groups = _check_groups(name, k, group_size)
        _check(name, "scales", scales, (groups, n), scales.dtype)
        _check(name, "qzeros", qzeros, (groups, n // per_word))
        q = unpack_int32(qweight, bits, dim=0).t()
        zeros = unpack_int32(qzeros, bits, dim=1)[:, :n].t() + zero_offset
        return grouped_weight(name, q, scales.t(), zeros, bits, t.get("g_idx"))

    size = "channel" if group_size == -1 else f"groups of {group_size}"
    return CheckpointScheme(description=f"GPTQ {bits}-bit, {size}{', act-order' if act_order else ''}",
                            method=f"int{bits}", cpu_fused=_fused(bits, group_size, act_order, config),
                            markers=_MARKERS, suffixes=_SUFFIXES, ignored=frozenset(), convert=convert,
                            cpu_reference=reference_fused(bits, group_size))


def awq_scheme(config: dict) -> CheckpointScheme:
    bits = int(config.get("bits", config.get("w_bit", 4)))
    group_size = int(config.get("group_size", config.get("q_group_size", 128)))
    version = str(config.get("version", "gemm")).lower()
    if bits != 4 or version != "gemm":
        raise ModelLoadError(f"AWQ {version} with {bits}-bit weights is not supported (GEMM, 4-bit is)")

    def convert(name: str, t: dict[str, torch.Tensor], k: int) -> LoadedWeight:
        qweight, qzeros, scales = (_need(name, t, s) for s in ("qweight", "qzeros", "scales"))
        n = qweight.shape[1] * 8 if qweight.dim() == 2 else 0
        _check(name, "qweight", qweight, (k, n // 8))
        groups = _check_groups(name, k, group_size)
        _check(name, "scales", scales, (groups, n), scales.dtype)
        _check(name, "qzeros", qzeros, (groups, n // 8))
        return grouped_weight(name, unpack_awq(qweight).t(), scales.t(), unpack_awq(qzeros).t(), 4)

    return CheckpointScheme(description=f"AWQ GEMM 4-bit, groups of {group_size}", method="int4",
                            cpu_fused=group_size % 32 == 0, markers=_MARKERS, suffixes=_SUFFIXES - {"g_idx"},
                            ignored=frozenset(), convert=convert, cpu_reference=True)


def _fused(bits: int, group_size: int, act_order: bool, config: dict) -> bool:
    """The fused CPU step reads kaon's int4 in groups of 32, its per-channel int8 and GGUF's group-int8
    (groups of 16): on CPU wider groups are split into those. 8-bit groups that are not a multiple of 16 it reads
    as held, with float32 activations (REF_Q8_G: models/fused_weights.linear_weights)."""
    if act_order:
        return False
    return group_size == -1 or bits == 8 or group_size % 32 == 0


def reference_fused(bits: int, group_size: int) -> bool:
    """The fused CPU step's reference kinds (cpu_decode.c REF_*) read int4 in any group (act-order included) and
    int8 per channel or in any group dividing K: groups of 16's multiples in Q8_G16's layout (REF_Q8_G16), others
    as quant/group_int8.py holds them (REF_Q8_G)."""
    return bits in (4, 8)


def _check_groups(name: str, k: int, group_size: int) -> int:
    """How many groups the layer's k input rows make; the group size must divide them."""
    size = k if group_size == -1 else group_size
    if k % size:
        raise ValueError(f"{name}: the group size {group_size} does not divide its {k} input rows")
    return k // size


def _check(name: str, suffix: str, tensor: torch.Tensor, shape: tuple[int, ...],
           dtype: torch.dtype = torch.int32) -> None:
    if tensor.dtype != dtype or tuple(tensor.shape) != shape:
        raise ValueError(f"{name}.{suffix} is {tensor.dtype} {tuple(tensor.shape)}, expected {dtype} {shape} "
                         "(truncated or from another layer?)")


def _need(name: str, t: dict[str, torch.Tensor], suffix: str) -> torch.Tensor:
    if suffix not in t:
        raise ValueError(f"{name}.{suffix} is missing from the checkpoint")
    return t[suffix]
