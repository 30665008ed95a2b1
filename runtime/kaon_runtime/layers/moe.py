"""Sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks k experts per token.

Under tensor parallelism every rank holds every expert, cut like a dense MLP (its share
of each expert's intermediate features); the router is replicated and the partial outputs
are summed by one all-reduce.

A quantized checkpoint's experts (AWQ, GPTQ, compressed-tensors, GGUF blocks) stay quantized: each
expert's gate|up and down become one of kaon's quantized linears (QuantizedExperts), and the float
w13 / w2 are dropped before any memory is given to them. Each expert then multiplies the rows routed
to it through that linear's own kernel: torch's packed int4 / int8 kernels on CPU, the Triton
W4A16 / W8A16 GEMMs on a GPU (there is no quantized variant of the fused kernel yet).

On CPU the fused C step runs these layers itself where it runs the model (models/cpu_decode_step.py
FusedExperts, cpu_decode.c experts_mlp): each row routed alone as `route` does, float or quantized experts
through its own kernels, so a token's numbers do not depend on the rows beside it; this module's forward is
then the reference its tests compare with (and the path without the step: tensor parallelism, no compiler). Picking the
experts reads the routing on the host, so such a model runs its GPU decode steps without CUDA graphs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.kernels import cpu_f64
from kaon_runtime.kernels.moe_ref import moe_ref, route
from kaon_runtime.layers import rows_alone
from kaon_runtime.layers.activation import silu_and_mul


class Router(nn.Module):
    """The gate's weight [E, H]. Not an nn.Linear, so that quantization leaves routing in full precision."""

    def __init__(self, num_experts: int, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel, kernel=None, invariant: bool = False,
                 rows_alone: bool = False):
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
        # The GPU's batch-invariant kernels (KAON_GPU_BATCH_INVARIANT): the router's logits through the invariant
        # GEMM (F.linear's cuBLAS picks its kernel by the row count), the experts' sum in slot order (kernels.moe).
        self.invariant = invariant
        self.rows_alone = rows_alone  # a float64 model on CPU: the router's logits each row alone (layers/rows_alone)
        self.quantized: QuantizedExperts | None = None

    def drop_float_experts(self) -> None:
        """Forget w13 and w2 (call on the meta model): a quantized checkpoint fills the experts instead."""
        del self.w13, self.w2

    def keep_experts_quantized(self, gate_up: list[nn.Module], down: list[nn.Module]) -> None:
        """Run the experts through these quantized linears (one per expert, stacked gate|up rows), float copy gone."""
        if "w13" in self._parameters:
            self.drop_float_experts()
        self.quantized = QuantizedExperts(gate_up, down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self._router_logits(x), self.top_k, self.renormalize)
        weights = weights.to(x.dtype)  # HF scales the experts' outputs in the model's dtype
        if self.quantized is not None:
            out = self.quantized(x, weights, ids)
        elif self.kernel is None:
            out = moe_ref(x, self.w13, self.w2, weights, ids, silu_and_mul)
        else:
            out = self.kernel(x, self.w13, self.w2, weights, ids)
        return self.tp.all_reduce(out)


    def _router_logits(self, x: torch.Tensor) -> torch.Tensor:
        if self.invariant:
            from kaon_runtime.kernels import invariant_gemm  # on use: CPU-only torch builds lack Triton
            return invariant_gemm.linear(x, self.gate.weight)
        if self.rows_alone and self.gate.weight.dtype == torch.float64 and rows_alone.applies(x):
            return cpu_f64.linear(x, self.gate.weight)
        return F.linear(x, self.gate.weight)


class QuantizedExperts(nn.Module):
    """Each expert's gate|up and down projection as a quantized linear; the rows each expert was
    picked for go through its two linears (what moe_ref does with float weights)."""

    def __init__(self, gate_up: list[nn.Module], down: list[nn.Module]):
        super().__init__()
        if len(gate_up) != len(down):
            raise ValueError(f"{len(gate_up)} experts' gate|up projections but {len(down)} down projections")
        self.gate_up, self.down = nn.ModuleList(gate_up), nn.ModuleList(down)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            hidden = silu_and_mul(self.gate_up[expert](x[tokens]))
            out.index_add_(0, tokens, self.down[expert](hidden) * weights[tokens, slots, None].to(x.dtype))
        return out


def has_quantized_experts(model: nn.Module) -> bool:
    """Whether any MoE layer of `model` runs quantized experts (their routing is read on the host)."""
    return any(isinstance(m, SparseMoE) and m.quantized is not None for m in model.modules())
