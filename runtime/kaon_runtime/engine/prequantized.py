"""A checkpoint its publisher quantized (AWQ, GPTQ, compressed-tensors), placed in the model kept narrow.

Before any memory is allocated, each linear whose weight the checkpoint holds quantized is
replaced by a PendingLinear (its bias only), so no float copy of those weights ever exists.
The float tensors stream into the model as usual; the quantized modules' tensors are set
aside, and once the stream ends each module's parts are converted to kaon's layouts
(quant/checkpoint_formats), cut to this rank's shard, fused (q|k|v, gate|up) and installed.
A mixture-of-experts layer whose experts are quantized drops its float w13 / w2 the same way
(before any memory), and gets one quantized linear per expert's gate|up and down (layers.moe).
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import cut
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.layers.moe import SparseMoE
from kaon_runtime.loader import Checkpoint
from kaon_runtime.loader.mapped_safetensors import release_pages
from kaon_runtime.models.weights import qwen3_moe_name, target
from kaon_runtime.quant.checkpoint_formats import CheckpointScheme, LoadedWeight, concat_rows, scheme_from_config
from kaon_runtime.quant.dynamic_fp8 import DynamicFp8InputLinear
from kaon_runtime.quant.dynamic_inputs import DynamicInt8Linear
from kaon_runtime.quant.pending import PendingLinear
from kaon_runtime.quant.static_inputs import StaticInputLinear

log = logging.getLogger(__name__)


def checkpoint_scheme(checkpoint: Checkpoint) -> CheckpointScheme | None:
    """The checkpoint's own quantization, or None for a float checkpoint."""
    if checkpoint.quantization_config is None:
        return None
    return scheme_from_config(checkpoint.quantization_config)


def reference_arithmetic(requested_dtype: str, scheme: CheckpointScheme | None) -> bool:
    """Whether a quantized checkpoint runs what its format specifies (quant/reference.py): asked for by
    `--dtype float32` on a checkpoint its publisher quantized; the default keeps kaon's fast kernels."""
    return scheme is not None and requested_dtype == "float32"


def check_requested(scheme: CheckpointScheme, requested: str) -> None:
    """--quantization on a quantized checkpoint must name the checkpoint's own family (or be "none")."""
    if requested not in ("none", scheme.method):
        raise ModelLoadError(f"the checkpoint is already quantized ({scheme.description}); --quantization "
                             f"{requested} does not match it: leave it out, or pass {scheme.method}")


@dataclass
class Prequantized:
    scheme: CheckpointScheme
    config: ModelConfig  # the whole model's, as tensor-parallel cutting reads it
    parts: dict[str, list[str]]  # our module -> the checkpoint modules that fill it, in fusion order
    # our MoE layer -> (its local gate|up rows and hidden size; per expert, the checkpoint modules of its
    # gate|up, in order, and of its down projection)
    experts: dict[str, tuple[tuple[int, int], list[tuple[list[str], list[str]]]]] = field(default_factory=dict)
    held: defaultdict[str, dict[str, torch.Tensor]] = field(default_factory=lambda: defaultdict(dict))
    dropped: set[str] = field(default_factory=set)  # suffixes read and not used (activation, KV cache scales)

    @classmethod
    def plan(cls, model: nn.Module, checkpoint: Checkpoint, scheme: CheckpointScheme) -> Prequantized:
        """Which of `model`'s linears the checkpoint fills quantized; swaps them for PendingLinears (call on meta)."""
        assert checkpoint.tensor_names is not None, "a quantized checkpoint lists its tensors"
        modules = dict(model.named_modules())
        found: defaultdict[str, list[tuple[int, str]]] = defaultdict(list)
        experts: defaultdict[str, dict[tuple[int, int | None], str]] = defaultdict(dict)
        for name in scheme.quantized_modules(checkpoint.tensor_names()):
            param, part = target(qwen3_moe_name(f"{name}.weight"))
            if isinstance(part, tuple):  # (expert, gate 0 / up 1 / down None) of the MoE layer `param` is in
                experts[param.rpartition(".")[0]][part] = name
                continue
            ours = param.removesuffix(".weight")
            if not isinstance(modules.get(ours), nn.Linear):
                raise ModelLoadError(f"quantized module {name!r} has no linear layer to go to: kaon reads the "
                                     "decoder's projections and experts quantized, not the embedding or lm_head")
            found[ours].append((part if isinstance(part, int) else 0, name))
        for ours in found:
            parent, _, child = ours.rpartition(".")
            setattr(modules[parent], child, PendingLinear(modules[ours]))
        parts = {ours: [name for _, name in sorted(found_parts)] for ours, found_parts in found.items()}
        return cls(scheme, checkpoint.config, parts, {moe: _expert_plan(modules.get(moe), moe, named)
                                                      for moe, named in experts.items()})

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
        self._check_weights_present()
        modules = dict(model.named_modules())
        for ours, names in self.parts.items():
            pending = modules[ours]
            assert isinstance(pending, PendingLinear)
            parent, _, child = ours.rpartition(".")
            module = self._module(ours, names, (pending.out_features, pending.in_features), pending.bias, device, tp)
            setattr(modules[parent], child, module)
        for moe, ((two_width, hidden), experts) in self.experts.items():
            gate_up = [self._module(f"{moe}.experts.{e}.gate_up_proj", names, (two_width, hidden), None, device, tp)
                       for e, (names, _) in enumerate(experts)]
            down = [self._module(f"{moe}.experts.{e}.down_proj", names, (hidden, two_width // 2), None, device, tp)
                    for e, (_, names) in enumerate(experts)]
            cast(SparseMoE, modules[moe]).keep_experts_quantized(gate_up, down)
        log.info("%s: %d linear layers and %d MoE layers' experts kept quantized%s", self.scheme.description,
                 len(self.parts), len(self.experts),
                 f", inputs rounded to their static {self.scheme.static_inputs} scales" if self.scheme.static_inputs
                 else "")
        if self.dropped:
            log.warning("the checkpoint's %s are not used: activations stay in the model's dtype (fp8 on a GPU "
                        "quantizes them per row itself) and the KV cache keeps --kv-cache-dtype",
                        ", ".join(sorted(self.dropped)))

    def _check_weights_present(self) -> None:
        """A module with quantization tensors (scales, zeros) but no weight was planned as no layer, so its fused
        layer came out short ("qkv_proj is 256 x 256"): name the module and what it lacks instead."""
        planned = {name for names in self.parts.values() for name in names}
        planned |= {name for _, experts in self.experts.values() for parts in experts for names in parts
                    for name in names}
        orphans = sorted(set(self.held) - planned)
        if orphans:
            raise ValueError(f"{orphans[0]} has {', '.join(sorted(self.held[orphans[0]]))} but no quantized weight: "
                             "the checkpoint lacks it (a shard left out, or a tensor dropped)")

    def _module(self, ours: str, names: list[str], expected: tuple[int, int], bias: torch.Tensor | None,
                device: torch.device, tp: TensorParallel) -> nn.Module:
        """The quantized linear `ours` of the checkpoint modules `names` (their rows stacked), this rank's shard."""
        inputs = [self._static_input(name) for name in names] if self.scheme.static_inputs else []
        sources = [tensor for name in names for tensor in self.held.get(name, {}).values()]
        weight = concat_rows([self._shard(name, tp) for name in names], ours)
        shape = (weight.out_features, _in_features(weight))
        if shape != expected:
            raise ValueError(f"quantized {ours} is {shape[0]} x {shape[1]}, the model expects "
                             f"{expected[0]} x {expected[1]}")
        module = weight.to_module(bias, device)
        if self.scheme.dynamic_inputs == "int8":  # W8A8: inputs quantized per token, int8 x int8 products
            module = DynamicInt8Linear.from_int8(module)
        elif self.scheme.dynamic_inputs == "fp8":  # FP8 dynamic: inputs rounded to FP8 per token
            module = DynamicFp8InputLinear(module)
        if inputs:  # fused parts read one input: the widest of their grids, as vLLM takes
            scale, zero = max(inputs, key=lambda found: float(found[0]))
            module = StaticInputLinear(module, str(self.scheme.static_inputs), scale.to(device),
                                       None if zero is None else zero.to(device))
        # Converted: the file's pages under the checkpoint's tensors leave resident memory now, not when the
        # load ends (they were one more copy of the narrow weights at the load's peak: issue 49 §3).
        for tensor in sources:
            release_pages(tensor)
        return module

    def _static_input(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        tensors = self.held.get(name, {})
        scale = tensors.pop("input_scale", None)
        if scale is None or scale.numel() != 1:
            raise ValueError(f"{name}.input_scale is {'missing' if scale is None else tuple(scale.shape)}: the "
                             "checkpoint's static input_activations need one scale per quantized linear")
        return scale, tensors.pop("input_zero_point", None)

    def _shard(self, name: str, tp: TensorParallel) -> LoadedWeight:
        tensors = self.held.pop(name, {})
        standard = qwen3_moe_name(f"{name}.weight")  # the names tensor-parallel cutting knows
        try:
            weight = self.scheme.convert(name, tensors, _in_features_of(standard, self.config))
        except (RuntimeError, IndexError) as exc:  # torch on a tensor of the wrong size
            raise ValueError(f"{name}: quantized tensors {sorted(tensors)} do not fit together: {exc}") from exc
        if tp.size == 1:
            return weight
        if weight.perm is not None and (".o_proj" in standard or ".down_proj" in standard):
            raise ModelLoadError(f"{name}: act-order (g_idx) weights of a row-parallel layer cannot be split "
                                 "across tensor-parallel ranks yet; use tensor_parallel_size 1")
        n, k = weight.out_features, _in_features(weight)
        # Cut index grids the way a float weight is cut: the rows and input columns this rank keeps.
        rows = cut(standard, torch.arange(n)[:, None].expand(n, k), self.config, tp.rank, tp.size)[:, 0]
        cols = cut(standard, torch.arange(k)[None, :].expand(n, k), self.config, tp.rank, tp.size)[0]
        return weight.select((int(rows[0]), rows.numel()), (int(cols[0]), cols.numel()))


def _in_features_of(name: str, c: ModelConfig) -> int:
    """A checkpoint linear's whole input width (the model's row-parallel layers hold a shard of it)."""
    if ".o_proj" in name:
        return c.num_heads * c.head_dim
    if ".experts." in name and ".down_proj" in name:
        return c.moe_intermediate_size
    if ".down_proj" in name:
        return c.intermediate_size
    return c.hidden_size


def _in_features(weight: LoadedWeight) -> int:
    first = next(iter(weight.tensors.values()))
    return first.shape[1] * (2 if weight.kind == "int4" else 1)


def _expert_plan(moe: nn.Module | None, name: str, named: dict[tuple[int, int | None], str]
                 ) -> tuple[tuple[int, int], list[tuple[list[str], list[str]]]]:
    """Per expert of the MoE layer `name`, its checkpoint gate and up modules and its down module; the layer's
    float experts are dropped (on meta). Every expert's three projections must be quantized."""
    if not isinstance(moe, SparseMoE):
        raise ModelLoadError(f"quantized experts {sorted(named.values())[:2]} have no mixture-of-experts layer "
                             "to go to")
    experts, two_width, hidden = moe.w13.shape
    missing = [f"expert {e} {part}" for e in range(experts) for shard, part in ((0, "gate"), (1, "up"), (None, "down"))
               if (e, shard) not in named]
    if missing or len(named) != 3 * experts:
        raise ModelLoadError(f"{name}: the checkpoint quantizes some of its {experts} experts' projections and not "
                             f"others ({', '.join(missing[:3]) or 'experts beyond the model'}); kaon keeps a "
                             "layer's experts all quantized or all float")
    moe.drop_float_experts()
    return (two_width, hidden), [([named[(e, 0)], named[(e, 1)]], [named[(e, None)]]) for e in range(experts)]
