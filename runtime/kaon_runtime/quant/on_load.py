"""Quantize a float checkpoint while it loads, one linear at a time (issue 49 §3).

`--quantization int8 / int4 / fp8` on a float checkpoint used to build the whole float model, load it, and only
then swap each nn.Linear for its quantized twin (quant/surgery.py): the float model existed whole at the load's
peak (1.8x the settled memory on the bundled model; for an 8B model the 16-32 GB float copy on a pod sized for
the int4 one). Now, on the meta device before any memory is allocated, each linear surgery would quantize is
taken out of the module tree (`defer`) and a `DeferredLinear` holds its place; `to_empty` allocates nothing for it.
As the weights stream in (models/weights.load), the first part of a linear's weight or bias allocates that linear's
float tensors (`buffer`); once every part of both has arrived (`filled`: q|k|v and gate|up come in parts) the linear
is quantized by surgery's own code, the quantized module takes its place and the float tensors go. So at most the
linears whose parts are still arriving (one fused projection of one layer, in any checkpoint that keeps a layer's
tensors together) are float at once, and the quantized numbers are those surgery made from the whole float model
(the same float tensor, the same function: tests/unit/runtime/quant/test_quantize_on_load.py).

The same idea as vLLM's online FP8 (weights created on meta, materialized just in time, processed once all their
elements are loaded: vllm-project/vllm#29196, #31914) and SGLang's (sgl-project/sglang#17945); written here for
kaon's loader.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch
from torch import nn

from kaon_runtime.quant.int4 import DEFAULT_GROUP_SIZE
from kaon_runtime.quant.surgery import METHODS, quantize_head, quantized_linear

_F32 = 4
HEAD_TABLE = "lm_head.weight_t"  # (the vocabulary head's float table, tied or not: models/weights.py names it so)


class DeferredLinear(nn.Module):
    """Holds the place of a linear that is quantized as its weights arrive. The meta nn.Linear is kept outside the
    module tree (a plain attribute), so `to_empty` and `parameters()` never see it."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.__dict__["linear"] = linear

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a linear quantized on load never received its weights")


@dataclass
class _Pending:
    parent: nn.Module
    child: str
    linear: nn.Linear  # on meta until its first part arrives
    params: set[str]  # the local names ("weight", "bias") not filled yet


@dataclass
class QuantizeOnLoad:
    """The deferred linears of one model, quantized by `method` as their parts complete."""

    method: str
    device: torch.device
    group_size: int = DEFAULT_GROUP_SIZE
    # Called after each linear is quantized: on CPU the loader returns the freed heap to the system (glibc keeps
    # freed chunks under its mmap threshold, up to 32 MiB each, and a small model's float weights, interleaved
    # with the int8 results, piled up: the bundled model's load still peaked at 1.57x without it).
    release: Callable[[], None] | None = None
    pending: dict[str, _Pending] = field(default_factory=dict)  # module name -> what it still waits for
    # The model whose vocabulary head gets its int8 copy as soon as its float table is in (None: at the end, by
    # surgery): the table arrives early in a safetensors file, and an exact int8 table (a dequantized Q8_0 one)
    # drops the float one then, so the float table never sits beside the quantized linears.
    head_of: nn.Module | None = None
    quantized: list[str] = field(default_factory=list)  # module names, in the order they were quantized

    def watched(self) -> set[str]:
        """Parameters the model allocates itself whose completion `filled` is told of: the head's float table."""
        head = getattr(self.head_of, "lm_head", None)
        return {HEAD_TABLE} if head is not None and isinstance(getattr(head, "weight_t", None), nn.Parameter) else set()

    def places(self) -> dict[str, torch.Tensor]:
        """Parameter name -> its meta tensor, for every deferred parameter still waiting (shapes for the loader)."""
        return {f"{name}.{param}": getattr(item.linear, param) for name, item in self.pending.items()
                for param in item.params}

    def buffer(self, param_name: str) -> torch.Tensor:
        """The float tensor the loader copies `param_name`'s parts into: allocated on its first part."""
        module, _, param = param_name.rpartition(".")
        item = self.pending.get(module)
        if item is None or param not in item.params:
            raise ValueError(f"{param_name}: a tensor arrived for a linear already quantized")
        tensor = getattr(item.linear, param)
        if tensor.is_meta:
            tensor = nn.Parameter(torch.empty_like(tensor, device=self.device), requires_grad=False)
            setattr(item.linear, param, tensor)
        return tensor.data

    @torch.no_grad()
    def filled(self, param_name: str) -> None:
        """Every part of `param_name` has arrived; once its linear's weight and bias have, quantize it."""
        if param_name == HEAD_TABLE:
            assert self.head_of is not None
            quantize_head(self.head_of)
            if self.release is not None:
                self.release()
            return
        module, _, param = param_name.rpartition(".")
        item = self.pending[module]
        item.params.discard(param)
        if item.params:
            return
        del self.pending[module]
        setattr(item.parent, item.child, quantized_linear(item.linear, self.method, self.group_size))
        for param in ("weight", "bias"):  # the float tensors go now, whoever still holds the linear
            item.linear.register_parameter(param, None)
        self.quantized.append(module)
        if self.release is not None:
            self.release()


def defer(model: nn.Module, method: str, device: torch.device, group_size: int = DEFAULT_GROUP_SIZE,
          release: Callable[[], None] | None = None, skip: Collection[str] = (), head: bool = False) -> QuantizeOnLoad:
    """Take every nn.Linear of `model` (on meta) out of its tree for on-load quantization by `method` (the linears
    quant/surgery.quantize_model would quantize from float: a PendingLinear's weight comes quantized already; `skip`:
    module names left to surgery, which gives them a checkpoint's own quantized weight after the float load)."""
    if method not in METHODS:
        raise ValueError(f"unknown quantization {method!r}; supported: {', '.join(METHODS)}")
    plan = QuantizeOnLoad(method, device, group_size, release=release, head_of=model if head else None)
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and name not in skip:
                params = {"weight"} | ({"bias"} if child.bias is not None else set())
                plan.pending[name] = _Pending(parent, child_name, child, params)
                setattr(parent, child_name, DeferredLinear(child))
    return plan


def quantized_bytes(method: str, out_features: int, in_features: int, group_size: int = DEFAULT_GROUP_SIZE) -> int:
    """A linear's weight quantized by `method`, in bytes (int8 and fp8: a byte a weight and float32 scales per row,
    twice for int8's CPU copy of them; int4: half a byte a weight and float16 scale and min per group)."""
    weights = out_features * in_features
    if method == "int4":
        return weights // 2 + 4 * (weights // group_size)
    return weights + out_features * _F32 * (2 if method == "int8" else 1)


def transient_bytes(out_features: int, in_features: int, dtype_bytes: int) -> int:
    """The most memory one linear's quantization holds beyond its result: its float weight in the model's dtype,
    and up to three float32 temporaries of its size (quantize_int8 / int4 / fp8: the float32 copy, the scaled
    and the rounded weight)."""
    return out_features * in_features * (dtype_bytes + 3 * _F32)
