"""A quantized linear held once, in the fused CPU step's layout (issue 49: quantized weights were held twice).

The fused C step (kernels/cpu_decode.c) reads kaon's int8 and its int4 in groups of 32 (GGUF Q4_1's layout,
float16 or float32 scales) in an interleaved layout: eight output rows side by side. It used to make that layout
as a copy beside the module's own tensors, which stayed for torch's path, so most of a model's weight bytes were
in memory twice. Now, once an engine's model is loaded, every projection the step reads hands it its tensors
(`hold`, called by engine/model_loader through DecoderForCausalLM.hold_kernel_layouts): the module keeps the
interleaved copy as its buffers and drops its own. (quant/group_int8.py and quant/bit_planes.py hold the kernel's
layout from the start.) What still runs the module's own forward then reads that copy (`matmul`):

  - KAON_CPU_PREFILL=torch's prompt chunks, a step with adapters the C step cannot read, QuantizedExperts'
    forward on those paths: the plain layout is rebuilt for the call (a copy of the narrow weight), then from
    DENSE_ROWS rows on the same dense GEMM as before; fewer rows: int8 torch's packed kernel as before (the
    same numbers), int4 the dense GEMM too (float activations: torch's packed int4 kernel needs a layout of its
    own, which would be a second copy again);
  - a tied vocabulary lookup (Int8Linear.rows) reads the rows it needs out of the interleaved copy.

Left as they were (nothing to hold, or no step to hold for): linears of the reference mode (--dtype float32; the
step reads their own layouts in place), int4 in other groups, any weight off the CPU (the GPU path), a machine
without a C compiler, and models the step does not run (`blocker`). (At widths that are not whole blocks of 32 the
held int8 copy is packed with zero columns, cpu_decode.padded_columns, and int4 is quantized to whole groups.)
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_cpu import DENSE_ROWS


def can_hold(module: nn.Module, weight: torch.Tensor) -> bool:
    """Whether `module` (its narrow weight `weight`) may give up its own layout for the C step's."""
    # (any width: int8's copy is packed with zero columns to whole blocks; int4 holds only in groups of 32)
    return (weight.device.type == "cpu" and not getattr(module, "reference", False)
            and cpu_decode.library() is not None)


def hold(module: nn.Module, held: cpu_decode.LinearWeights, drop: tuple[str, ...]) -> cpu_decode.LinearWeights:
    """`module` keeps `held`'s tensors as its buffers (kernel_w, kernel_scales, ...: so sleep level 2 writes and
    maps them back like any weight) and drops its buffers `drop`; returns `held` (module.kernel_weights)."""
    for name in drop:
        module._buffers.pop(name, None)
    for name, tensor in held.named().items():
        if name != "bias":  # (the module's own bias, read in place or as a float32 copy)
            module.register_buffer(f"kernel_{name}", tensor, persistent=False)
    setattr(module, "kernel_weights", held)  # noqa: B010 -- (nn.Module's __setattr__ is typed for tensors and modules)
    return held


def matmul(x: torch.Tensor, kernel: str, dense: Callable[[torch.Tensor], torch.Tensor],
           few: Callable[[torch.Tensor], torch.Tensor], reference: Callable[[torch.Tensor], torch.Tensor]
           ) -> torch.Tensor:
    """x [M, K] times a held weight, without its bias, each path on the plain layout rebuilt for the call: many rows
    through `dense` (one dense GEMM, as before), fewer through `few` (int8: torch's packed kernel, the same numbers
    as before; int4: the dense GEMM, float activations, as torch's packed int4 kernel would need its own copy), and
    `reference` for the reference arithmetic (kernel "torch") or a forced Triton on the CPU."""
    if kernel == "cpu":
        return dense(x) if x.shape[0] >= DENSE_ROWS else few(x)
    return reference(x)
