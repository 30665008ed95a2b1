"""The reference arithmetic of quantized weights: what a checkpoint's format specifies, nothing faster.

kaon's fast CPU paths change the activations a quantized weight multiplies: the fused C decode step and
the group-int8 / bit-plane few-row kernels round them to int8 in blocks of 32 (llama.cpp's trade), torch's
int4 / int8 weight-only kernels and the many-row dense GEMM take them in bfloat16. A W4A16 or W8A16
checkpoint specifies float activations, so those paths move its logits (by up to 0.06 nats on
llm-compressor's W8A16, issue 49). Under `--dtype float32` on a checkpoint quantized by its publisher,
every quantized linear is marked `reference`: it multiplies float32 activations by its dequantized
weight (kernels/quant_gemm_ref.py), and the activation quantization a W8A8 checkpoint specifies stays
where it is (quant/dynamic_inputs.py, quant/dynamic_fp8.py, quant/static_inputs.py).

Where the fused C step covers the model it runs this arithmetic too (issue 49 §2: torch's GEMMs sum a row by
the row count, so the reference mode's answers moved with batch neighbours, chunking and prefix-cache hits):
models/fused_weights.reference_weights hands a marked weight-only linear to the step's reference kinds
(kernels/cpu_decode.c REF_INT8, REF_Q4, REF_Q8_G16: the same float32 value per weight as quant_gemm_ref and
group_int8's dequantizers, in the layouts the loader holds, act-order included), and W8A8 / FP8 linears to the
kinds that apply their activation quantization exactly (INT8_A8, INT8_S8, FP8_A8, FP8_STATIC). What the step
cannot read keeps torch's reference path, its reason logged (engine/model_loader.pick_kernels).
"""
from __future__ import annotations

from torch import nn

from kaon_runtime.quant.linear import mark_quantized_linears


def use_reference_kernels(model: nn.Module) -> int:
    """Mark every quantized linear of `model` to run its reference arithmetic; how many there were."""
    return mark_quantized_linears(model, "reference")
