"""Where LoRA adapters attach to the decoder: PEFT's projection names onto kaon's fused projections.

q/k/v are the three parts of qkv_proj and gate/up the two of gate_up_proj; o_proj and down_proj
are whole. Under tensor parallelism the slots take the rank's shape (model.local_config) and each
rank holds its shard of every adapter (distributed.lora_sharding: A cut like the projection's input,
B like its output).
"""
from __future__ import annotations

import torch

from kaon_runtime.layers.lora import LoraBatch, LoraLinear
from kaon_runtime.models.decoder import DecoderForCausalLM

# PEFT's projection name -> (kaon's module under the decoder layer, which part of it)
TARGETS = {"q_proj": ("self_attn", "qkv_proj", 0), "k_proj": ("self_attn", "qkv_proj", 1),
           "v_proj": ("self_attn", "qkv_proj", 2), "o_proj": ("self_attn", "o_proj", 0),
           "gate_proj": ("mlp", "gate_up_proj", 0), "up_proj": ("mlp", "gate_up_proj", 1),
           "down_proj": ("mlp", "down_proj", 0)}


def attach_lora(model: DecoderForCausalLM, num_slots: int, max_rank: int, dtype: torch.dtype,
                device: torch.device) -> tuple[LoraBatch, dict[tuple[int, str], tuple[LoraLinear, int]]]:
    """Wrap every projection adapters may target in a LoraLinear with `num_slots` empty slots; return
    the batch they share and, per (layer, PEFT projection name), the wrapper and its part."""
    c = model.local_config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"qkv_proj": (c.hidden_size, [q, kv, kv]), "o_proj": (q, [c.hidden_size]),
              "gate_up_proj": (c.hidden_size, [c.intermediate_size] * 2),
              "down_proj": (c.intermediate_size, [c.hidden_size])}
    batch = LoraBatch()
    targets = {}
    for i, layer in enumerate(model.model.decoder_layers()):
        wrapped = {}
        for block_name, module_name in {(b, m) for b, m, _ in TARGETS.values()}:
            block = getattr(layer, block_name)
            if not hasattr(block, module_name):
                continue  # experts in place of the MLP: no adapter may target it (loader.lora_adapter)
            fan_in, parts = shapes[module_name]
            lora = LoraLinear(getattr(block, module_name), fan_in, parts, num_slots, max_rank, batch, dtype, device)
            setattr(block, module_name, lora)
            wrapped[module_name] = lora
        for proj, (_, module_name, part) in TARGETS.items():
            if module_name in wrapped:
                targets[(i, proj)] = (wrapped[module_name], part)
    model.model.lora = batch
    return batch, targets
