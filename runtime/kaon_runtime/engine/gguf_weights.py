"""A GGUF file's quantized layers kept quantized: which precision the file asks for, and its
blocks as kaon's weights, fused the way the model fuses its projections.

On CPU a GGUF runs in its own precision unless asked otherwise (`own_method`): int4 for a file
of 2- to 4-bit types (Q4_0, Q4_K_M's mix with Q6_K, Q2_K...), int8 for one of 5- to 8-bit types
(Q8_0, Q5_K_M); either way every layer keeps the file's own blocks, repacked exactly. `--dtype
float32` gives the dequantized float model; `--quantization int4` takes the file's 4-bit layers
and quantizes the rest, `--quantization int8` re-quantizes everything per channel.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from kaon_runtime.config import EngineConfig
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader import Checkpoint
from kaon_runtime.models.weights import target
from kaon_runtime.quant.gguf import BLOCKS, INT4_TYPES, KaonWeight, concat, repack
from kaon_runtime.quant.group_int8 import GroupInt8Weight

NARROW_TYPES = frozenset({"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K"})  # files of these run "int4"


def own_method(config: EngineConfig, checkpoint: Checkpoint, device_type: str) -> str | None:
    """int4 / int8 when this GGUF's layers stay quantized by default (CPU, no --dtype or
    --quantization asked), else None."""
    if device_type != "cpu" or config.dtype != "auto" or config.quantization != "none":
        return None
    kept: frozenset[str] = getattr(checkpoint, "quantized_types", frozenset()) & set(BLOCKS)
    if not kept:
        return None
    return "int4" if kept & NARROW_TYPES else "int8"


def gguf_prequantized(checkpoint: Checkpoint, device: torch.device, int4_only: bool = False) -> dict[str, KaonWeight]:
    """Module name -> the file's own weight for every projection whose parts are all kept types
    (q|k|v and gate|up fused; parts in different types meet in the group-int8 layout; an MoE layer's
    experts under "<moe>.experts.<e>.gate_up_proj" and ".down_proj", quant/surgery.py's keys); with
    int4_only, those that are int4 (for --quantization int4)."""
    blocks = getattr(checkpoint, "quantized_blocks", None)
    if blocks is None:
        return {}
    parts: defaultdict[str, dict] = defaultdict(dict)
    given = {}
    for name, type_name, data in blocks():
        if not _kept(type_name, device, int4_only):
            continue  # another type (an IQ quant): dequantized, then quantized by the method asked
        try:
            weight = repack(type_name, data)
        except ValueError as exc:
            raise ModelLoadError(f"{checkpoint.path.name}: tensor {name}: {exc}") from exc
        param, part = target(name)
        if isinstance(part, tuple):  # an expert's gate / up (fused per expert) or down: a linear of its own
            expert, shard = part
            moe = param.rpartition(".")[0]
            param, part = (f"{moe}.experts.{expert}.gate_up_proj.weight", shard) if shard is not None else (
                f"{moe}.experts.{expert}.down_proj.weight", None)
        parts[param][part] = weight
        wanted = _parts(param)
        if set(parts[param]) == set(wanted):  # fused now: the parts go before the next tensor is read
            shards = parts.pop(param)
            given[param.removesuffix(".weight")] = _to(concat([shards[s] for s in wanted]), device)
    return given


def held_linears(checkpoint: Checkpoint, device: torch.device, int4_only: bool = False) -> set[str]:
    """The model's linears (module names) that gguf_prequantized will give the file's own blocks for, read
    from the file's header alone: the loader holds their places on meta (quant/pending.py), so their float
    weights are never allocated nor dequantized. An MoE layer's experts are left to the float path."""
    names = getattr(checkpoint, "quantized_names", None)
    if names is None or getattr(checkpoint, "quantized_blocks", None) is None:
        return set()
    parts: defaultdict[str, set] = defaultdict(set)
    for name, type_name in names().items():
        param, part = target(name)
        if _kept(type_name, device, int4_only) and not isinstance(part, tuple):
            parts[param].add(part)
    return {param.removesuffix(".weight") for param, found in parts.items() if found == set(_parts(param))}


def table_held(checkpoint: Checkpoint, tied: bool, device: torch.device) -> bool:
    """Whether a tied vocabulary table comes as the file's own Q8_0 blocks: the int8 table kaon would make of it
    anyway (quant/surgery.py), exactly, so its float table need never exist."""
    return tied and device.type == "cpu" and getattr(checkpoint, "table_type", None) == "Q8_0"


def gguf_table(checkpoint: Checkpoint) -> GroupInt8Weight:
    blocks = getattr(checkpoint, "table_blocks", None)
    assert blocks is not None, "table_held said the checkpoint has its table's blocks"
    weight = repack("Q8_0", blocks())
    assert isinstance(weight, GroupInt8Weight)
    return weight


def _kept(type_name: str, device: torch.device, int4_only: bool) -> bool:
    """Whether a tensor of this GGML type keeps its blocks (int4_only: only where they are int4)."""
    # Off the CPU, int4 takes the float16-scaled types only (the GPU kernels are tested with those).
    int4_types = INT4_TYPES if device.type == "cpu" else ("Q4_0", "Q4_1")
    return type_name in BLOCKS and (not int4_only or type_name in int4_types)


def _parts(param: str) -> list[int | None]:
    return [0, 1, 2] if "qkv_proj" in param else [0, 1] if "gate_up_proj" in param else [None]


def _to(weight: KaonWeight, device: torch.device) -> KaonWeight:
    for field in weight.__slots__:
        value = getattr(weight, field)
        if isinstance(value, torch.Tensor):
            setattr(weight, field, value.to(device))
    return weight
