"""LoRA adapters in PEFT's format: adapter_config.json and adapter_model.safetensors.

An adapter is read once, checked against the model it is to run on (target modules, shapes,
rank), and kept as plain tensors per (layer, projection): A [r, in] and B [out, r], with the
scaling (lora_alpha / r, or lora_alpha / sqrt(r) under rsLoRA) folded into B. Anything PEFT
can express that the batched computation cannot (DoRA, biases, modules_to_save, per-module rank
patterns, experts, embeddings) is refused with the reason, so an adapter never runs half-applied.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import InvalidRequestError

# The projections an adapter may target, by the name PEFT gives them, with the decoder block they sit in.
PROJECTIONS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
               "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class AdapterError(InvalidRequestError):
    """The adapter cannot run on this model (the reason is the message)."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    name: str
    path: str
    rank: int
    # (layer, projection) -> (A [r, in], B [out, r] with the scaling folded in), float32 on CPU
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of each targetable projection of the whole (unsharded) model."""
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}


def read_config(path: Path) -> dict:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise AdapterError(f"{path} has no adapter_config.json (a PEFT LoRA adapter directory is expected)")
    return json.loads(config_file.read_text())


def check_config(config: dict, model: ModelConfig, max_rank: int) -> float:
    """Raise AdapterError if the adapter's config does not fit; return its scaling."""
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"only LoRA adapters are served, not {config.get('peft_type')}")
    rank = int(config.get("r", 8))
    problems = [
        (config.get("use_dora"), "DoRA is not supported"),
        (config.get("bias", "none") != "none", f"bias={config.get('bias')!r} is not supported (only 'none')"),
        (config.get("modules_to_save"), f"modules_to_save {config.get('modules_to_save')} is not supported"),
        (config.get("rank_pattern") or config.get("alpha_pattern"), "per-module rank or alpha patterns"
                                                                    " are not supported"),
        (rank > max_rank, f"its rank {rank} is over the server's max LoRA rank {max_rank}"),
    ]
    targets = config.get("target_modules") or []
    targets = [targets] if isinstance(targets, str) else list(targets)
    unknown = [t for t in targets if t not in PROJECTIONS]
    problems.append((unknown, f"target modules {unknown} are not among the projections {sorted(PROJECTIONS)}"))
    moe_targets = [t for t in targets if t in MLP_PROJECTIONS]
    problems.append((model.num_experts and moe_targets,
                     f"target modules {moe_targets} sit in the mixture-of-experts MLP (experts are not supported)"))
    reasons = [reason for applies, reason in problems if applies]
    if reasons:
        raise AdapterError("; ".join(reasons))
    alpha = float(config.get("lora_alpha", rank))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_adapter(name: str, path: str | Path, model: ModelConfig, max_rank: int) -> LoraAdapter:
    """Read and check an adapter directory; raise AdapterError with the reason when it does not fit."""
    path = Path(path)
    scaling = check_config(read_config(path), model, max_rank)
    weights_file = path / "adapter_model.safetensors"
    if not weights_file.is_file():
        raise AdapterError(f"{path} has no adapter_model.safetensors")
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _KEY.search(key)
        if match is None or match.group(3) not in PROJECTIONS:
            raise AdapterError(f"tensor {key} is not a LoRA weight of a decoder projection")
        layer, _, proj, which = match.groups()
        parts.setdefault((int(layer), proj), {})[which] = tensor.float()
    shapes = projection_shapes(model)
    weights, rank = {}, 0
    for (layer, proj), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"} or not 0 <= layer < model.num_layers:
            raise AdapterError(f"layer {layer} {proj}: needs lora_A and lora_B within the model's "
                               f"{model.num_layers} layers")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = shapes[proj]
        if a.shape[1] != fan_in or b.shape[0] != fan_out or a.shape[0] != b.shape[1]:
            raise AdapterError(f"layer {layer} {proj}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not "
                               f"fit the model's projection ({fan_in} in, {fan_out} out): another base model?")
        if a.shape[0] > max_rank:
            raise AdapterError(f"layer {layer} {proj}: rank {a.shape[0]} is over the max LoRA rank {max_rank}")
        weights[(layer, proj)] = (a.contiguous(), (b * scaling).contiguous())
        rank = max(rank, a.shape[0])
    if not weights:
        raise AdapterError(f"{path}: the adapter has no LoRA weights")
    return LoraAdapter(name, str(path), rank, weights)
