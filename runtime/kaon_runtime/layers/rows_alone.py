"""A float64 model on CPU, each row computed alone (issue 49 §2: the same request gets the same answer in every
precision).

Every other precision on CPU takes the fused C step (models/cpu_decode_step.py), which computes each row alone.
float64 stays on torch's path (it is the tests' exactness oracle against transformers' float64, whose arithmetic the
float32-inside C step would not keep), and torch's float64 GEMMs move a row's bits with the step's row count. So a
float64 model is built with these parts (layers/kernel_backend.py `cpu_rows_alone`), each summing every output of a
row in an order fixed by the weights' shapes and the row's own context (kernels/cpu_f64.py, cpu_decode.c):

  - RowsAloneLinear: every projection (q|k|v, o, gate|up, down);
  - RowsAloneAttention: every row of the step, prompt rows included, as a decode row against the cache up to itself
    (their keys and values are written first), so a prompt token computes as in any chunk, after any cached prefix;
  - experts / the router (layers/moe.py) and the vocabulary head (layers/vocab.py) through the same GEMM.

What remains torch's is elementwise or a reduction within a row (the norms, rotary, the gated activation, the
residual adds, the embedding lookup, the routing's softmax and top-k): a row's numbers are its own there already.
Each part falls back to torch's own where its inputs are not float64 on the CPU or the C library cannot be built.
Not covered (torch's path, not invariant): LoRA adapters' terms, quantized weights in a float64 model, tensor
parallelism from three ranks (gloo's sum order).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kaon_runtime.kernels import cpu_f64, paged_attention_ref as ref
from kaon_runtime.kernels.moe_ref import moe_ref
from kaon_runtime.layers.activation import silu_and_mul
from kaon_runtime.layers.attention import AttentionMetadata, TorchAttentionBackend, as_decode_rows


def gaps(quantization: str, kv_dtype: torch.dtype, tp_size: int, lora: bool) -> str | None:
    """What of a float64 model's step these parts would not cover (its answers then not batch invariant), or None.
    KAON_CPU_PREFILL=torch (models/cpu_decode_step.prefills_take_the_c_step) opts out here too: torch's GEMMs whole."""
    reasons = [
        (os.environ.get("KAON_CPU_PREFILL", "fused") == "torch", "KAON_CPU_PREFILL=torch"),
        (quantization != "none", f"{quantization} weights (their own kernels)"),
        (kv_dtype != torch.float64, f"a {str(kv_dtype).removeprefix('torch.')} KV cache"),
        (tp_size > 2, "tensor parallelism from three ranks (the all-reduce's order moves with the step's size)"),
        (lora, "LoRA adapters (their terms through torch's GEMMs)"),
        (not cpu_f64.available(), "the C kernels could not be built"),
    ]
    found = [reason for applies_, reason in reasons if applies_]
    return ", ".join(found) or None


def applies(x: torch.Tensor) -> bool:
    """Whether a float64 tensor on the CPU, with the kernels built."""
    return x.dtype == torch.float64 and x.device.type == "cpu" and cpu_f64.available()


class RowsAloneLinear(nn.Linear):
    """nn.Linear (a subclass: loading, quantization and LoRA find it as one) whose float64 product on CPU sums each
    output of a row in an order that depends on in_features alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (applies(x) and self.weight.dtype == torch.float64):
            return super().forward(x)
        out = cpu_f64.linear(x.reshape(-1, self.in_features), self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)


class RowsAloneAttention(TorchAttentionBackend):
    """Torch's attention backend, but float64 steps on CPU take every row as a decode row through kaon_attention_f64:
    the step's keys and values written first, then each row against its own context (as_decode_rows)."""

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        if not (applies(q) and k_cache.dtype == torch.float64):
            return super().forward(q, k, v, k_cache, v_cache, meta, scale, window, softcap)
        ref.write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        tables, lens = as_decode_rows(meta)
        return cpu_f64.attention(q, k_cache, v_cache, tables, lens, scale, window, softcap)


def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
            ids: torch.Tensor) -> torch.Tensor:
    """kernels.moe_ref's experts (SiLU-gated), each expert's rows through the float64 GEMM: a row's products do not
    depend on how many rows picked its expert; the row's outputs are summed in expert order, as moe_ref does."""
    if not (applies(x) and w13.dtype == torch.float64):
        return moe_ref(x, w13, w2, weights, ids, silu_and_mul)
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slots = (ids == expert).nonzero(as_tuple=True)
        hidden = silu_and_mul(cpu_f64.linear(x[tokens], w13[expert]))
        out.index_add_(0, tokens, cpu_f64.linear(hidden, w2[expert]) * weights[tokens, slots, None].to(x.dtype))
    return out
