"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks k experts per token.

Under tensor parallelism every rank holds every expert, cut like a dense MLP (its share
of each expert's intermediate features); the router is replicated and the partial outputs
are summed by one all-reduce.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.kernels.moe_ref import moe_ref, route
from kaon_runtime.layers.activation import silu_and_mul


class Router(nn.Module):
    """The gate's weight [E, H]. Not an nn.Linear, so that quantization leaves routing in full precision."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, kernel=None):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"mixture-of-experts layers support the silu activation only, not {config.hidden_act!r}")
        self.tp = tp
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        experts, width, hidden = config.num_experts, config.moe_intermediate_size, config.hidden_size
        self.gate = Router(experts, hidden)
        self.w13 = nn.Parameter(torch.empty(experts, 2 * width, hidden))  # gate | up of each expert
        self.w2 = nn.Parameter(torch.empty(experts, hidden, width))
        self.kernel = kernel  # a fused kernel (kernels.moe.fused_moe), or None: the torch reference

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        weights = weights.to(x.dtype)  # HF scales the experts' outputs in the model's dtype
        if self.kernel is None:
            out = moe_ref(x, self.w13, self.w2, weights, ids, silu_and_mul)
        else:
            out = self.kernel(x, self.w13, self.w2, weights, ids)
        return self.tp.all_reduce(out)
