"""Pure-torch mixture of experts: top-k routing and the expert MLPs; the CPU path and the
reference for the fused Triton kernel (kernels.moe).

Experts are stored stacked: w13 [E, 2I, H] holds each expert's gate and up projections
(gate rows first), w2 [E, H, I] its down projection.
"""
from __future__ import annotations

from collections.abc import Callable

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k]).

    Softmax over all experts in float32, then the top k; renormalize divides them by their
    sum (Mixtral always does, Qwen3-MoE when norm_topk_prob is set).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_ref(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
            gated_act: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """x [T, H] through the experts ids [T, k] chose, each output scaled by its weight [T, k] and summed.

    One expert at a time, over the tokens that picked it (a token picks an expert once at
    most); gated_act maps a fused gate|up row to act(gate) * up.
    """
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        hidden = gated_act(x[tokens] @ w13[expert].t())
        out.index_add_(0, tokens, (hidden @ w2[expert].t()) * weights[tokens, slots, None].to(x.dtype))
    return out
