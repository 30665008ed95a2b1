"""The GPU's batch-invariant kernels for quantized linears (issue 49 §2; layers/kernel_backend.py `batch_invariant`).

By default a quantized linear on a GPU takes kernels/quant_gemv.py for a few rows and quant_gemm.py's tiles (by
M), torch._scaled_mm or F.linear for more: a row's numbers move with the step's size. A linear marked here
computes every row in one order fixed by its weight's shape, whatever M is (kernels/invariant_gemm.py):
- int4 (kaon's, GGUF Q4_1 / Q4_K, GPTQ / AWQ / compressed-tensors W4A16) and int8 per channel (W8A16): quant_gemm's
  tl.dot kernels at one tile and split of K for every M;
- FP8 per channel: weight-only (W8A16) for every M, the FP8 bytes widened exactly in the tile; a W8A8 FP8
  dynamic checkpoint rounds each input row to FP8 first (quant/dynamic_fp8.py), as its format specifies;
- FP8 blocks: each weight times its block's scale formed in the tile (the dequantized weight's exact values);
- GGUF's group-int8 and bit-plane weights: dequantized to the activations' dtype (as their default GPU path
  does) and multiplied by the invariant dense GEMM;
- W8A8 int8 (quant/dynamic_inputs.py) needs nothing: its integer sums are exact in any order.
Built and tested in Triton's interpreter; untried on a GPU until a lease measures it (bench/gpu/invariant_gemm.py).
"""
from __future__ import annotations

from torch import nn

from kaon_runtime.quant.linear import mark_quantized_linears


def use_batch_invariant_kernels(model: nn.Module) -> int:
    """Mark every quantized linear of `model` (the vocabulary head's int8 copy included) to run the batch-invariant
    kernels on a GPU; how many there were."""
    return mark_quantized_linears(model, "batch_invariant")
