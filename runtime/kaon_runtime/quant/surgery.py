"""Module surgery: swap a model's nn.Linear layers for quantized ones, in place.

Our models keep the token embedding and the vocabulary head outside nn.Linear (VocabEmbedding
and VocabHead). Under every method the head's logits come from an int8 copy of its weight: at
batch-1 decode the head is the largest single read (49,152 x 576 for SmolLM2, a fifth of its
weights), and int8 keeps its error far below int4's or fp8's (bench/RESULTS.md, quantization
quality). An untied head gets one scale per vocabulary row; the embedding stays in full precision.
A tied table that int8 in groups of 32 holds exactly (a GGUF's Q8_0 table, dequantized) becomes
that one int8 table (quant/group_int8.py), read by both the logits and the token lookup: the float
table, the model's largest tensor, goes. Any other tied table keeps its float copy for the lookup.
A mixture-of-experts layer's experts are kept as the GGUF file's own blocks where it gives them all
(prequantized keys "<moe>.experts.<e>.gate_up_proj" / ".down_proj"); otherwise they stay float.
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.quant.bit_planes import BitPlanesLinear, BitPlanesWeight
from kaon_runtime.quant.fp8 import Fp8Linear
from kaon_runtime.quant.group_int8 import GroupInt8Linear, GroupInt8Weight
from kaon_runtime.quant.int4 import DEFAULT_GROUP_SIZE, Int4Linear, Int4Weight
from kaon_runtime.quant.int8 import Int8Linear
from kaon_runtime.quant.pending import PendingLinear
from kaon_runtime.quant.row_chunks import (
    CHUNK_ROWS,
    equal_after_group_int8,
    quantize_group_int8_rows,
    quantize_int8_rows,
)

METHODS = ("int8", "int4", "fp8")
HEAD_TABLE = "lm_head"  # prequantized's key for a tied head's int8 table given as it is (a GGUF's Q8_0 blocks)


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   prequantized: dict[str, Int4Weight | GroupInt8Weight | BitPlanesWeight] | None = None) -> list[str]:
    """Replace every nn.Linear by its `method` twin; return the replaced modules' names.

    `prequantized` weights (module name -> Int4Weight, GroupInt8Weight or BitPlanesWeight: a GGUF file's own
    blocks, repacked by quant/gguf.py) are taken as they are, whatever the method; the rest are
    quantized from their float weights. Each given weight leaves `prequantized` as its module takes it: the
    group-int8 and bit-plane linears hold their kernel's layout, a copy, so a dict that kept every given weight
    to the end held the file's layers twice at the load's peak (issue 49 §3).
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    prequantized = prequantized or {}
    swapped = []
    # The parents alone are listed: a list of every module would keep each replaced float linear alive
    # until the end, and the load's peak with it.
    parents = [(name, module) for name, module in model.named_modules()
               if any(isinstance(child, (nn.Linear, PendingLinear)) for child in module.children())]
    for parent_name, parent in parents:
        for child_name in [name for name, _ in parent.named_children()]:
            child = getattr(parent, child_name)
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, PendingLinear):  # its place held on meta: the given weight is the only one
                if name not in prequantized:
                    raise ValueError(f"{name}: no quantized weight was given for its held place")
                module = _prequantized(prequantized.pop(name), child.out_features, child.in_features, child.bias)
            elif isinstance(child, nn.Linear):
                module = _quantized(child, method, group_size, prequantized.pop(name, None))
            else:
                continue
            del child  # the float weight goes as soon as its module does, not after its siblings'
            setattr(parent, child_name, module)
            swapped.append(name)
    swapped += _keep_experts(model, prequantized)
    _quantize_head(model, prequantized.pop(HEAD_TABLE, None))
    return swapped


def _keep_experts(model: nn.Module, given: dict[str, Int4Weight | GroupInt8Weight | BitPlanesWeight]) -> list[str]:
    """Give each MoE layer (layers.moe.SparseMoE) whose every expert is prequantized those weights as linears."""
    kept = []
    for name, moe in model.named_modules():
        if not hasattr(moe, "keep_experts_quantized") or "w13" not in moe._parameters:
            continue
        experts, two_i, hidden = moe.w13.shape
        keys = [f"{name}.experts.{e}.{part}" for e in range(experts) for part in ("gate_up_proj", "down_proj")]
        if not all(key in given for key in keys):
            continue
        gate_up = [_prequantized(given.pop(keys[2 * e]), two_i, hidden, None) for e in range(experts)]
        down = [_prequantized(given.pop(keys[2 * e + 1]), hidden, two_i // 2, None) for e in range(experts)]
        moe.keep_experts_quantized(gate_up, down)
        kept += keys
    return kept


def quantize_head(model: nn.Module) -> None:
    """The vocabulary head's int8 copy, from its float table (quant/on_load.py: as soon as the table has loaded)."""
    _quantize_head(model)


def _quantize_head(model: nn.Module, table: object = None) -> None:
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "quantized") or head.quantized is not None:
        return  # (no head, or quantized already: as its table loaded, quant/on_load.py)
    if head.weight_t is None:  # its float table was never allocated (quant/pending.py hold_table)
        if not isinstance(table, GroupInt8Weight):
            raise ValueError("the vocabulary table's place was held but no int8 table was given")
        head.quantized = GroupInt8Linear(table)
        return
    tied = getattr(model.model, "embed_tokens", None) is None
    # Row by row in chunks (quant/row_chunks.py): the table is the largest tensor, and whole-table
    # temporaries would be the load's peak.
    # A table int8 holds exactly shows it in its first rows already: any other skips the whole group-int8 try.
    # (only at a width of whole groups of 32, quantize_group_int8's: a GGUF's Q8_0 table always is one, and another
    # width raised here, so a tied model at hidden 48 could not be quantized at all)
    whole_groups = head.weight_t.shape[0] % 32 == 0
    if tied and whole_groups and equal_after_group_int8(quantize_group_int8_rows(head.weight_t.t()[:CHUNK_ROWS]),
                                                        head.weight_t.t()[:CHUNK_ROWS]):
        table = quantize_group_int8_rows(head.weight_t.t())
        if equal_after_group_int8(table, head.weight_t.t()):  # a GGUF's Q8_0 table: held once, exactly
            head.quantized = GroupInt8Linear(table)
            head.drop_float_table()
            return
    head.quantized = Int8Linear(*quantize_int8_rows(head.weight_t.t()))
    if not tied:
        head.weight_t = None  # the token lookup has its own table, nothing reads the float head now


def quantized_linear(linear: nn.Linear, method: str, group_size: int = DEFAULT_GROUP_SIZE) -> nn.Module:
    """`linear`'s `method` twin, from its float weight (quant/on_load.py quantizes each linear as it loads)."""
    return _quantized(linear, method, group_size, None)


def _quantized(linear: nn.Linear, method: str, group_size: int,
               given: Int4Weight | GroupInt8Weight | BitPlanesWeight | None) -> nn.Module:
    if isinstance(given, (BitPlanesWeight, GroupInt8Weight)) or (isinstance(given, Int4Weight) and method != "int4"):
        # a checkpoint's own weights, whatever the method
        return _prequantized(given, linear.out_features, linear.in_features, linear.bias)
    if method == "int8":
        return Int8Linear.from_linear(linear)
    if method == "fp8":
        return Fp8Linear.from_linear(linear)
    if given is None:
        return Int4Linear.from_linear(linear, group_size)
    return Int4Linear(_fitting(given, linear), linear.bias)


def _prequantized(given: Int4Weight | GroupInt8Weight | BitPlanesWeight, out_features: int, in_features: int,
                  bias: torch.Tensor | None) -> nn.Module:
    """The linear that runs a checkpoint's own weight, which must be out_features x in_features."""
    module: nn.Module
    if isinstance(given, BitPlanesWeight):  # a GGUF's own 5- and 6-bit weights
        shape, module = tuple(given.values.shape), BitPlanesLinear(given, bias)
    elif isinstance(given, GroupInt8Weight):  # a checkpoint's own 5- to 8-bit weights
        shape, module = tuple(given.qweight.shape), GroupInt8Linear(given, bias)
    else:
        shape, module = (given.packed.shape[0], given.packed.shape[1] * 2), Int4Linear(given, bias)
    if shape != (out_features, in_features):
        raise ValueError(f"prequantized {type(given).__name__} {shape} does not fit a {out_features} x {in_features} "
                         "linear layer")
    return module


def _fitting(given: Int4Weight, linear: nn.Linear) -> Int4Weight:
    if given.packed.shape[0] != linear.out_features or given.packed.shape[1] * 2 != linear.in_features:
        raise ValueError(f"prequantized int4 weight {tuple(given.packed.shape)} does not fit {linear}")
    return given
