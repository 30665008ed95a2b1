"""Module surgery: swap a model's nn.Linear layers for quantized ones, in place.

Our models keep the token embedding and the vocabulary head outside nn.Linear (VocabEmbedding
and VocabHead). The embedding stays in full precision. The head's logits come from an int8
copy of its weight (one scale per vocabulary row) under every method: at batch-1 decode the
head is the largest single read (49,152 x 576 floats for SmolLM2, a fifth of its weights),
and int8 keeps its error far below int4's or fp8's (bench/RESULTS.md, quantization quality).
"""
from __future__ import annotations

import torch
from torch import nn

from kaon_runtime.quant.fp8 import Fp8Linear
from kaon_runtime.quant.int4 import DEFAULT_GROUP_SIZE, Int4Linear, Int4Weight
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8

METHODS = ("int8", "int4", "fp8")


@torch.no_grad()
def quantize_model(model: nn.Module, method: str, group_size: int = DEFAULT_GROUP_SIZE,
                   prequantized: dict[str, Int4Weight] | None = None) -> list[str]:
    """Replace every nn.Linear by its `method` twin; return the replaced modules' names.

    int4 takes `prequantized` weights (module name -> Int4Weight, e.g. a GGUF file's own
    Q4_1 blocks) where given and quantizes the rest from their float weights.
    """
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    prequantized = prequantized or {}
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            setattr(parent, child_name, _quantized(child, method, group_size, prequantized.get(name)))
            swapped.append(name)
    _quantize_head(model)
    return swapped


def _quantize_head(model: nn.Module) -> None:
    head = getattr(model, "lm_head", None)
    if head is None or not hasattr(head, "quantized"):
        return
    head.quantized = Int8Linear(*quantize_int8(head.weight_t.t()))
    if getattr(model.model, "embed_tokens", None) is not None:
        head.weight_t = None  # untied: the token lookup has its own table, nothing reads the float head now


def _quantized(linear: nn.Linear, method: str, group_size: int, given: Int4Weight | None) -> nn.Module:
    if method == "int8":
        return Int8Linear.from_linear(linear)
    if method == "fp8":
        return Fp8Linear.from_linear(linear)
    if given is None:
        return Int4Linear.from_linear(linear, group_size)
    if given.packed.shape[0] != linear.out_features or given.packed.shape[1] * 2 != linear.in_features:
        raise ValueError(f"prequantized int4 weight {tuple(given.packed.shape)} does not fit {linear}")
    return Int4Linear(given, linear.bias)
