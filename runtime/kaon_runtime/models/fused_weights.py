"""What the fused CPU step reads of a decoder, and how each part becomes the C step's structs.

The decoder exports its layers through a declared interface (FusedDecoder.fused_weights: FusedWeights of
FusedLayers, FusedExperts for a mixture-of-experts layer); the functions below turn one part at a time into
kernels/cpu_decode.py's ctypes structs, reading the tensors in place (no copy but the float32 norms and router;
group int8 holds the step's layout itself at every width, quant/group_int8.py): a projection in whatever
layout it is held (linear_weights; the reference mode's weight-only kinds, reference_weights), a layer's experts
(experts_struct), a projection's LoRA slots (lora_slots).
models/cpu_decode_step.py builds the whole model's structs from them and runs the step.
"""
from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.layers.invariant_linear import InvariantLinear
from kaon_runtime.layers.lora import LoraLinear


@dataclass(frozen=True, slots=True)
class FusedExperts:
    """What the fused step reads of a mixture-of-experts layer (layers/moe.py SparseMoE)."""

    router: torch.Tensor  # the gate's weight [E, H] (float: routing is never quantized)
    top_k: int
    renormalize: bool  # the chosen weights divided by their sum (norm_topk_prob; Mixtral always)
    # Each expert's gate|up and down: the float stacks w13 [E, 2W, H] and w2 [E, H, W] (read in place, expert by
    # expert), or a quantized checkpoint's per-expert linears (QuantizedExperts: anything linear_weights reads)
    gate_up: torch.Tensor | Sequence[nn.Module]
    down: torch.Tensor | Sequence[nn.Module]


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """What the fused step reads of one decoder layer."""

    qkv: nn.Module  # the projections: float32 nn.Linear, kaon's int8 or its int4 (see linear_weights), or
    # any of them in a LoraLinear
    o: nn.Module
    gate_up: nn.Module | None  # the dense MLP's; None in a mixture-of-experts layer (experts)
    down: nn.Module | None
    input_norm: torch.Tensor  # the two RMSNorm weights
    post_attention_norm: torch.Tensor
    k_cache: torch.Tensor | None  # [Hkv, num_blocks, block_size, D]; None before the pool is attached
    v_cache: torch.Tensor | None
    scale: float  # attention's score scale
    window: int | None = None  # the sliding window: a query sees itself and the window - 1 keys before it
    q_norm: torch.Tensor | None = None  # Qwen3: the RMSNorm weight [head_dim] every q head is normalised by
    k_norm: torch.Tensor | None = None  # (before rotary), and every k head's; None: no q/k norms
    pre_feedforward_norm: torch.Tensor | None = None  # Gemma 2's sandwich: the MLP's input norm (then
    post_feedforward_norm: torch.Tensor | None = None  # post_attention_norm normalises attention's output), and
    # the MLP output's norm; None: no sandwich
    experts: FusedExperts | None = None  # a mixture-of-experts layer's, in place of gate_up and down


@dataclass(frozen=True, slots=True)
class FusedWeights:
    """What the fused step reads of the decoder: its layers, the final norm, the rotary tables (float32, CPU)."""

    layers: list[FusedLayer]
    final_norm: torch.Tensor | None  # None: a pipeline stage before the last (it hands on the residual stream)
    cos: torch.Tensor
    sin: torch.Tensor


class FusedDecoder(Protocol):
    def fused_weights(self) -> FusedWeights:
        """Everything the step reads, as it is now (weights loaded, KV pool attached)."""

    def kv_cache_address(self) -> tuple[int, ...]:
        """The first layer's key cache address and shape: the step rebuilds its structs when either changes."""


def norm_copy(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An RMSNorm weight as the C step reads it: float32, Gemma's offset added (its checkpoints store weight - 1
    and the norm scales by 1 + weight, summed in float32 as layers/norm.py sums it), so the C step's one norm
    serves both."""
    copy = weight.detach().float()
    return (copy + config.norm_weight_offset if config.norm_weight_offset else copy).contiguous()


def linear_weights(module: nn.Module) -> cpu_decode.LinearWeights:
    """A projection as the C step reads it: float32 nn.Linear, kaon's int8 (per channel or in groups of
    16), its int4 (groups of 32, float16 or float32 scales) or its fp8 (per channel, in blocks, with static FP8
    inputs); a LoraLinear's base."""
    if isinstance(module, LoraLinear):
        module = module.base
    reference = reference_weights(module)
    if reference is not None:
        return reference
    bias = getattr(module, "bias", None)
    if type(module) is nn.Linear or type(module) is InvariantLinear:  # a plain float weight (the GPU switch: forward)
        return cpu_decode.LinearWeights.f32(module.weight, bias)
    qweight = getattr(module, "qweight", None)
    quantized: Any = module  # quant's linears: their tensors are plain attributes
    # held in the kernel's own layout (quant/group_int8.py, bit_planes.py, kernel_layout.py): the struct re-pointed
    # at the module's buffers as they are now (sleep level 2 swaps their storage)
    held = getattr(module, "kernel_weights", None)
    if held is not None:
        return held.rebound()
    if hasattr(module, "group_scales"):  # group int8 in groups Q8_G16 cannot hold (not a multiple of 16, e.g. 8):
        # read as held with float32 activations (the reference kind: a row's numbers its own; these took torch's
        # path before, which widened the whole weight per call and summed a row by the step's row count)
        return cpu_decode.LinearWeights.ref_q8_g(quantized.qvalues, quantized.group_scales, quantized.group_mins,
                                                 quantized.group_size, bias)
    fused = getattr(module, "fused_cpu_weights", None)  # read in place: fp8 (quant/fp8.py, quant/dynamic_fp8.py)
    if fused is not None:
        return fused()
    if qweight is not None and qweight.dtype == torch.int8:
        return cpu_decode.LinearWeights.int8(qweight, quantized.scales, bias)
    if getattr(module, "group_size", None) == cpu_decode.QBLOCK and hasattr(module, "packed"):
        # (int4 at a K that is not whole groups: packed to whole groups, its inputs zero-padded, quant/int4.py)
        f32 = quantized.scales.dtype == torch.float32  # GGUF Q4_K's exact scales
        make = cpu_decode.LinearWeights.q4_f32 if f32 else cpu_decode.LinearWeights.q4_1
        return make(quantized.packed, quantized.scales, quantized.mins, bias).with_true_width(quantized.in_features)
    raise ValueError(f"no fused CPU kernel for {type(module).__name__}")


def reference_weights(module: nn.Module) -> cpu_decode.LinearWeights | None:
    """A weight-only projection in the reference mode (quant/reference.py: `reference` set) as the C step's
    reference kinds read it, its tensors in place: int8 per channel (quant/int8.py), kaon's int4 layout in any
    even group (quant/int4.py) or group int8 in Q8_G16's layout, or in its own where its groups are not a multiple
    of 16 (quant/group_int8.py; REF_Q8_G), behind act-order's column
    order (an InputPermutedLinear) or not. None for every other module: float weights, and the W8A8 / FP8 kinds
    (fused_cpu_weights), whose fused kinds already compute what their checkpoints specify. ValueError for a
    reference weight-only projection no kind reads (pick_kernels' blocker keeps those on torch's path)."""
    inner = getattr(module, "inner", None)
    perm = getattr(module, "perm", None) if inner is not None else None
    target = inner if perm is not None else module
    if not getattr(target, "reference", False) or hasattr(target, "fused_cpu_weights"):
        return None
    quantized: Any = target
    bias = getattr(target, "bias", None)
    held = getattr(target, "kernel_weights", None)
    if held is not None and held.struct.kind == cpu_decode.KIND_Q8_G16:
        return cpu_decode.LinearWeights.ref_q8_g16(held.rebound(), perm)
    if hasattr(target, "group_scales"):  # group int8 in groups Q8_G16 cannot hold (not a multiple of 16): as held
        return cpu_decode.LinearWeights.ref_q8_g(quantized.qvalues, quantized.group_scales, quantized.group_mins,
                                                 quantized.group_size, bias, perm)
    if hasattr(target, "packed"):
        padded = quantized.packed.shape[1] * 2
        if perm is not None and quantized.in_features < padded:  # (the padding columns keep their places)
            perm = torch.cat([perm.to(torch.int64), torch.arange(quantized.in_features, padded)])
        return cpu_decode.LinearWeights.ref_q4(quantized.packed, quantized.scales, quantized.mins,
                                               quantized.group_size, bias, perm).with_true_width(quantized.in_features)
    qweight = getattr(target, "qweight", None)
    if perm is None and qweight is not None and qweight.dtype == torch.int8 and quantized.scales.dim() == 1:
        return cpu_decode.LinearWeights.ref_int8(qweight, quantized.scales, bias)
    raise ValueError(f"no reference kernel in the fused CPU step for {type(target).__name__}")


def hold_kernel_layout(module: nn.Module) -> bool:
    """Whether the projection now holds its narrow weight only in the C step's layout (quant/kernel_layout.py:
    kaon's int8 and int4 in groups of 32 hand it over; a LoraLinear's base; the group-int8 and bit-plane linears
    hold it from the start)."""
    if isinstance(module, LoraLinear):
        module = module.base
    hold = getattr(module, "hold_kernel_layout", None)
    return (hold() if hold is not None else getattr(module, "kernel_weights", None)) is not None


def expert_linears(stack: torch.Tensor | Sequence[nn.Module]) -> list[cpu_decode.LinearWeights]:
    """One projection per expert as the C step reads it: slices of a float stack [E, N, K] (views, no copy), or
    each expert's own linear (linear_weights: ValueError where it has no kernel)."""
    if isinstance(stack, torch.Tensor):
        return [cpu_decode.LinearWeights.f32(stack[e]) for e in range(stack.shape[0])]
    return [linear_weights(module) for module in stack]


def experts_struct(experts: FusedExperts, activation_passes: int) -> tuple[cpu_decode.Experts, list[object]]:
    """A mixture-of-experts layer as the C step reads it, and what its pointers point into (kept alive by the
    caller). The router goes in as a float32 copy (a bfloat16 or float16 model's is widened exactly)."""
    router = cpu_decode.LinearWeights.f32(experts.router.detach().float())
    gate_up, down = expert_linears(experts.gate_up), expert_linears(experts.down)
    if len(gate_up) != len(down) or len(gate_up) != router.struct.n or not 0 < experts.top_k <= len(gate_up):
        raise ValueError(f"{router.struct.n} experts routed (top {experts.top_k}), {len(gate_up)} gate|up and "
                         f"{len(down)} down projections")
    arrays = []
    for linears in (gate_up, down):
        array = (cpu_decode.Linear * len(linears))(*(w.struct for w in linears))
        for linear in array:  # (copies of the structs, as the dense projections' are)
            if linear.kind not in cpu_decode.UNQUANTIZED_INPUTS:
                linear.act_passes = activation_passes
        arrays.append(array)
    struct = cpu_decode.Experts(num_experts=len(gate_up), top_k=experts.top_k, renormalize=int(experts.renormalize),
                                width=gate_up[0].struct.n // 2, router=router.struct,
                                gate_up=ctypes.cast(arrays[0], ctypes.POINTER(cpu_decode.Linear)),
                                down=ctypes.cast(arrays[1], ctypes.POINTER(cpu_decode.Linear)))
    return struct, [router, *gate_up, *down, *arrays]


def lora_slots(module: nn.Module) -> tuple[cpu_decode.Lora, list[torch.Tensor]] | None:
    """A projection's LoRA slots as the C step reads them (all zero: it has none), and the tensors
    they point at; None where it cannot read them (not a float32, float16 or bfloat16 CPU tensor: steps
    with adapters take torch). Half slots (a half model's) are widened in registers as they are read.
    The slots are read in place, so adapters loaded later are seen."""
    if not isinstance(module, LoraLinear):
        return cpu_decode.Lora(), []
    if module.a.dtype not in cpu_decode.KV_FORMATS or module.a.device.type != "cpu":
        return None
    assert module.b.dtype == module.a.dtype and module.a.is_contiguous() and module.b.is_contiguous()
    sizes = (ctypes.c_int32 * cpu_decode.LORA_PARTS)(*module.parts)
    struct = cpu_decode.Lora(a=module.a.data_ptr(), b=module.b.data_ptr(), ranks=module.ranks.data_ptr(),
                             parts=len(module.parts), rank=module.rank, sizes=sizes,
                             fmt=cpu_decode.KV_FORMATS[module.a.dtype])
    return struct, [module.a, module.b, module.ranks]
