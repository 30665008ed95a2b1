"""A checkpoint its publisher quantized (AWQ, GPTQ, compressed-tensors), placed in the model kept narrow.

Before any memory is allocated, each linear whose weight the checkpoint holds quantized is
replaced by a PendingLinear (its bias only), so no float copy of those weights ever exists.
The float tensors stream into the model as usual; the quantized modules' tensors are set
aside, and once the stream ends each module's parts are converted to kaon's layouts
(quant/checkpoint_formats), cut to this rank's shard, fused (q|k|v, gate|up) and installed.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import cut
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.loader import Checkpoint
from kaon_runtime.models.weights import target
from kaon_runtime.quant.checkpoint_formats import CheckpointScheme, LoadedWeight, concat_rows, scheme_from_config
from kaon_runtime.quant.static_inputs import StaticInputLinear

log = logging.getLogger(__name__)


def checkpoint_scheme(checkpoint: Checkpoint) -> CheckpointScheme | None:
    """The checkpoint's own quantization, or None for a float checkpoint."""
    if checkpoint.quantization_config is None:
        return None
    return scheme_from_config(checkpoint.quantization_config)


def check_requested(scheme: CheckpointScheme, requested: str) -> None:
    """--quantization on a quantized checkpoint must name the checkpoint's own family (or be "none")."""
    if requested not in ("none", scheme.method):
        raise ModelLoadError(f"the checkpoint is already quantized ({scheme.description}); --quantization "
                             f"{requested} does not match it: leave it out, or pass {scheme.method}")


class PendingLinear(nn.Module):
    """Holds a linear's place (and its float bias) until its quantized weight is installed."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("a quantized linear was never installed")


@dataclass
class Prequantized:
    scheme: CheckpointScheme
    config: ModelConfig  # the whole model's, as tensor-parallel cutting reads it
    parts: dict[str, list[str]]  # our module -> the checkpoint modules that fill it, in fusion order
    held: defaultdict[str, dict[str, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    dropped: set[str] = field(default_factory=set)  # suffixes read and not used (activation, KV cache scales)

    @classmethod
    def plan(cls, model: nn.Module, checkpoint: Checkpoint, scheme: CheckpointScheme) -> Prequantized:
        """Which of `model`'s linears the checkpoint fills quantized; swaps them for PendingLinears (call on meta)."""
        assert checkpoint.tensor_names is not None, "a quantized checkpoint lists its tensors"
        modules = dict(model.named_modules())
        found: defaultdict[str, list[tuple[int, str]]] = defaultdict(list)
        for name in scheme.quantized_modules(checkpoint.tensor_names()):
            param, part = target(f"{name}.weight")
            ours = param.removesuffix(".weight")
            if not isinstance(modules.get(ours), nn.Linear):
                raise ModelLoadError(f"quantized module {name!r} has no linear layer to go to: kaon reads the "
                                     "decoder's projections quantized, not yet experts, the embedding or lm_head")
            found[ours].append((part if isinstance(part, int) else 0, name))
        for ours in found:
            parent, _, child = ours.rpartition(".")
            setattr(modules[parent], child, PendingLinear(modules[ours]))
        parts = {ours: [name for _, name in sorted(found_parts)] for ours, found_parts in found.items()}
        return cls(scheme, checkpoint.config, parts)

    def set_aside(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The float tensors, passed on; the quantized modules' tensors kept for install()."""
        for name, tensor in weights:
            if self.scheme.owns(name, tensor.dtype):
                module, _, suffix = name.rpartition(".")
                if suffix in self.scheme.ignored:
                    self.dropped.add(suffix)
                else:
                    self.held[module][suffix] = tensor
            else:
                yield name, tensor

    @torch.no_grad()
    def install(self, model: nn.Module, device: torch.device, tp: TensorParallel) -> None:
        modules = dict(model.named_modules())
        for ours, names in self.parts.items():
            pending = modules[ours]
            assert isinstance(pending, PendingLinear)
            inputs = [self._static_input(name) for name in names] if self.scheme.static_inputs else []
            weight = concat_rows([self._shard(name, tp) for name in names], ours)
            shape, expected = (weight.out_features, _in_features(weight)), (pending.out_features, pending.in_features)
            if shape != expected:
                raise ValueError(f"quantized {ours} is {shape[0]} x {shape[1]}, the model expects "
                                 f"{expected[0]} x {expected[1]}")
            parent, _, child = ours.rpartition(".")
            module = weight.to_module(pending.bias, device)
            if inputs:  # fused parts read one input: the widest of their grids, as vLLM takes
                scale, zero = max(inputs, key=lambda found: float(found[0]))
                module = StaticInputLinear(module, str(self.scheme.static_inputs), scale.to(device),
                                           None if zero is None else zero.to(device))
            setattr(modules[parent], child, module)
        unused = sorted(set(self.held))
        if unused:
            raise ValueError(f"checkpoint tensors of {', '.join(unused[:3])} belong to no quantized layer")
        log.info("%s: %d linear layers kept quantized%s", self.scheme.description, len(self.parts),
                 f", inputs rounded to their static {self.scheme.static_inputs} scales" if self.scheme.static_inputs
                 else "")
        if self.dropped:
            log.warning("the checkpoint's %s are not used: activations stay in the model's dtype (fp8 on a GPU "
                        "quantizes them per row itself) and the KV cache keeps --kv-cache-dtype",
                        ", ".join(sorted(self.dropped)))

    def _static_input(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        tensors = self.held.get(name, {})
        scale = tensors.pop("input_scale", None)
        if scale is None or scale.numel() != 1:
            raise ValueError(f"{name}.input_scale is {'missing' if scale is None else tuple(scale.shape)}: the "
                             "checkpoint's static input_activations need one scale per quantized linear")
        return scale, tensors.pop("input_zero_point", None)

    def _shard(self, name: str, tp: TensorParallel) -> LoadedWeight:
        tensors = self.held.pop(name, {})
        try:
            weight = self.scheme.convert(name, tensors, _in_features_of(name, self.config))
        except (RuntimeError, IndexError) as exc:  # torch on a tensor of the wrong size
            raise ValueError(f"{name}: quantized tensors {sorted(tensors)} do not fit together: {exc}") from exc
        if tp.size == 1:
            return weight
        if weight.perm is not None and (".o_proj" in name or ".down_proj" in name):
            raise ModelLoadError(f"{name}: act-order (g_idx) weights of a row-parallel layer cannot be split "
                                 "across tensor-parallel ranks yet; use tensor_parallel_size 1")
        n, k = weight.out_features, _in_features(weight)
        # Cut index grids the way a float weight is cut: the rows and input columns this rank keeps.
        rows = cut(f"{name}.weight", torch.arange(n)[:, None].expand(n, k), self.config, tp.rank, tp.size)[:, 0]
        cols = cut(f"{name}.weight", torch.arange(k)[None, :].expand(n, k), self.config, tp.rank, tp.size)[0]
        return weight.select((int(rows[0]), rows.numel()), (int(cols[0]), cols.numel()))


def _in_features_of(name: str, c: ModelConfig) -> int:
    """A checkpoint linear's whole input width (the model's row-parallel layers hold a shard of it)."""
    if ".o_proj" in name:
        return c.num_heads * c.head_dim
    if ".down_proj" in name:
        return c.intermediate_size
    return c.hidden_size


def _in_features(weight: LoadedWeight) -> int:
    first = next(iter(weight.tensors.values()))
    return first.shape[1] * (2 if weight.kind == "int4" else 1)
