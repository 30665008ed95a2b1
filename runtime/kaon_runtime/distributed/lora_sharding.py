"""Which slice of a LoRA adapter a tensor-parallel rank keeps: A cut like the projection's input, B like its output.

A column-parallel projection (q/k/v, gate/up) keeps its output rows on each rank and takes the whole
input: its A [r, in] stays whole and its B [out, r] keeps the rank's rows, so the rank computes its own
rows of the adapter's change. A row-parallel one (o, down) keeps input columns: its A keeps the same
columns and its B stays whole, so x_shard @ A_shard.T @ B is a partial sum that the all-reduce after
the projection completes, with the base's partial sum. The rows and columns are the base weight's
(distributed.sharding.cut), so replicated KV heads are replicated in the adapter too.
"""
from __future__ import annotations

import torch

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.sharding import cut

ROW_PARALLEL = ("o_proj", "down_proj")


def cut_lora(proj: str, a: torch.Tensor, b: torch.Tensor, config: ModelConfig, rank: int,
             size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's A and B of one projection's adapter (`proj` by PEFT's name, A [r, in], B [out, r])."""
    if size == 1:
        return a, b
    name = f"model.layers.0.mlp.{proj}.weight" if proj in ("gate_proj", "up_proj", "down_proj") \
        else f"model.layers.0.self_attn.{proj}.weight"
    if proj in ROW_PARALLEL:
        return cut(name, a, config, rank, size), b
    return a, cut(name, b, config, rank, size)
