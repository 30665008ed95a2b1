"""Which slice of every weight a tensor-parallel rank keeps: pure functions of the model's shape.

Attention heads and the MLP's intermediate features are split evenly: q/k/v and gate/up
are column-parallel (a rank keeps the output rows of its heads or features), o_proj and
down_proj are row-parallel (it keeps the matching input columns, and the partial results
are summed across ranks). Mixture-of-experts layers are cut the same way inside every
expert (each rank holds all experts, a share of each one's width); their router is
replicated. When there are fewer KV heads than ranks, each KV head is
replicated on the ranks whose query heads use it. The vocabulary is split into equal
contiguous ranges, the last padded with zero rows, for both the embedding and the head.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from kaon_runtime.arith import ceil_div
from kaon_runtime.config import ModelConfig
from kaon_runtime.errors import ModelDoesNotFitError


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a group size the model's shape cannot be split into."""
    problems = []
    if config.num_heads % size:
        problems.append(f"its {config.num_heads} attention heads")
    if config.num_kv_heads % size and size % config.num_kv_heads:
        problems.append(f"its {config.num_kv_heads} KV heads (nor is it a multiple of them)")
    if config.intermediate_size % size:
        problems.append(f"its MLP width {config.intermediate_size}")
    if config.num_experts and config.moe_intermediate_size % size:
        problems.append(f"its experts' width {config.moe_intermediate_size}")
    if problems:
        raise ModelDoesNotFitError(f"tensor_parallel_size {size} does not divide {' or '.join(problems)}")


def local_config(config: ModelConfig, size: int) -> ModelConfig:
    """The shape one rank computes with: its share of the heads and of the MLP width."""
    return replace(config, num_heads=config.num_heads // size, num_kv_heads=max(config.num_kv_heads // size, 1),
                   intermediate_size=config.intermediate_size // size,
                   moe_intermediate_size=config.moe_intermediate_size // size)


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, start + shard) of the vocabulary on this rank; the last range may run past the end."""
    shard = ceil_div(vocab_size, size)
    return rank * shard, shard


def kv_head_start(num_kv_heads: int, rank: int, size: int) -> int:
    if num_kv_heads >= size:
        return rank * (num_kv_heads // size)
    return rank // (size // num_kv_heads)  # replicated: the KV head this rank's query heads share


def cut(name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int) -> torch.Tensor:
    """This rank's slice of the HF-named checkpoint tensor `name` (a view where possible)."""
    if size == 1:
        return tensor
    local = local_config(config, size)
    d = config.head_dim
    if ".q_proj." in name:
        return tensor.narrow(0, rank * local.num_heads * d, local.num_heads * d)
    if ".k_proj." in name or ".v_proj." in name:
        return tensor.narrow(0, kv_head_start(config.num_kv_heads, rank, size) * d, local.num_kv_heads * d)
    if ".o_proj." in name:
        return tensor.narrow(1, rank * local.num_heads * d, local.num_heads * d)
    if ".experts." in name:  # one expert's gate/up (rows) or down (columns) projection
        width = local.moe_intermediate_size
        return tensor.narrow(1 if ".down_proj." in name else 0, rank * width, width)
    if ".gate_proj." in name or ".up_proj." in name:
        return tensor.narrow(0, rank * local.intermediate_size, local.intermediate_size)
    if ".down_proj." in name:
        return tensor.narrow(1, rank * local.intermediate_size, local.intermediate_size)
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(tensor, rank, size)
    return tensor  # norms and MoE routers: every rank needs all of them


def _vocab_rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    start, shard = vocab_range(tensor.shape[0], rank, size)
    rows = tensor[start:start + shard]
    if rows.shape[0] == shard:
        return rows
    padded = tensor.new_zeros(shard, *tensor.shape[1:])
    padded[:rows.shape[0]] = rows
    return padded
