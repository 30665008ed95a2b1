"""What a quantized checkpoint's config says, in the terms the loader needs."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kaon_runtime.quant.checkpoint_formats.loaded import LoadedWeight

# (module name, its tensors by the suffix after that name, its input features) -> kaon's weight for it.
Converter = Callable[[str, dict[str, torch.Tensor], int], LoadedWeight]


@dataclass(frozen=True, slots=True)
class CheckpointScheme:
    description: str  # for logs and errors, e.g. "GPTQ 4-bit, groups of 128"
    method: str  # kaon's family of the weights: "int4", "int8" or "fp8" (what --quantization must say, if anything)
    cpu_fused: bool  # whether the fused CPU decode step reads the weights as kaon's int4 / int8 / fp8
    markers: frozenset[str]  # suffixes whose presence makes a module quantized
    suffixes: frozenset[str]  # every suffix a quantized module's tensors may carry
    ignored: frozenset[str]  # suffixes read and dropped (static activation scales, KV cache scales)
    convert: Converter
    static_inputs: str | None = None  # "fp8" / "int8": inputs rounded to the checkpoint's input_scale first
    # "int8" / "fp8": inputs quantized per token at run time (quant/dynamic_inputs.py, quant/dynamic_fp8.py)
    dynamic_inputs: str | None = None
    # whether the fused CPU step reads the reference mode's arithmetic (--dtype float32: quant/reference.py) of
    # these weights; None: as cpu_fused (W8A8 / FP8: their fused kinds are that arithmetic already)
    cpu_reference: bool | None = None

    @property
    def cpu_reference_fused(self) -> bool:
        return self.cpu_fused if self.cpu_reference is None else self.cpu_reference

    def owns(self, name: str, dtype: torch.dtype) -> bool:
        """Whether the checkpoint tensor `name` belongs to a quantized module (or is one of the dropped)."""
        suffix = name.rpartition(".")[2]
        if suffix == "weight":  # int8 / fp8 weights keep the plain name; their dtype tells them apart
            return dtype in (torch.int8, torch.float8_e4m3fn)
        return suffix in self.suffixes or suffix in self.ignored

    def quantized_modules(self, names: list[str]) -> list[str]:
        """The modules (checkpoint names) whose weight the checkpoint stores quantized."""
        found = {name.rpartition(".")[0] for name in names if name.rpartition(".")[2] in self.markers}
        return sorted(found)
