"""The decoder every supported family shares (Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3, Gemma 2,
Phi-3, Mixtral, Qwen3-MoE), over a flattened token batch. The families differ only in options of
ModelConfig: q/k norms, sliding windows, soft-capping, sandwich norms, the MLP's activation, and
sparse experts in place of the MLP. Checkpoint names are mapped in models.weights.

Under tensor parallelism each rank builds the model with its share of the heads and of
the MLP width (`local_config`): q/k/v and gate/up are column-parallel, and the outputs of
o_proj and down_proj are partial sums that an all-reduce completes.
"""
from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import local_config
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.layers.activation import GATED_ACTIVATIONS
from kaon_runtime.layers.attention import Attention, AttentionMetadata
from kaon_runtime.layers.moe import SparseMoE
from kaon_runtime.layers.norm import RMSNorm
from kaon_runtime.layers.rotary import RotaryEmbedding, apply_rotary
from kaon_runtime.layers.vocab import VocabEmbedding, VocabHead
from kaon_runtime.models import weights as checkpoint_names
from kaon_runtime.models.cpu_decode_step import MAX_ROWS, CpuDecodeStep, head_weights, split_decodes, unsupported


def _norm(c: ModelConfig, size: int | None = None) -> RMSNorm:
    return RMSNorm(size or c.hidden_size, c.rms_norm_eps, c.norm_weight_offset)


class SelfAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel):
        super().__init__()
        c = config
        self.tp = tp
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rotary_dim = c.rotary_dim or c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        # Qwen3: each head's q and k are normalised (one weight over head_dim, shared by the heads) before rotary.
        self.q_norm = _norm(c, c.head_dim) if c.qk_norm else None
        self.k_norm = _norm(c, c.head_dim) if c.qk_norm else None
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim, c.attn_scale, c.window(layer), c.attn_softcap)
        self.rotary_kernel = None  # kernels.rotary.apply_rotary on the Triton backend

    def forward(self, rope, x, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2 Hkv, D]
        rotated_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :rotated_heads]  # q and k heads sit side by side: one pass
        if self.q_norm is not None:
            qk[:, :self.num_heads] = self.q_norm(qk[:, :self.num_heads])
            qk[:, self.num_heads:] = self.k_norm(qk[:, self.num_heads:])
        rotated = qk[..., :self.rotary_dim]  # Phi-3 variants may rotate only a leading part of each head
        if self.rotary_kernel is None:
            rotated.copy_(apply_rotary(rotated, *rope))
        else:
            self.rotary_kernel(rotated, *rope, out=rotated)  # in place: q and k stay views of qkv
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, rotated_heads:]
        out = self.attn(q, k, v, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class GatedMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = GATED_ACTIVATIONS[config.hidden_act]
        self.act_kernel = None  # kernels.activation.silu_and_mul on the Triton backend (SiLU models)

    def forward(self, x):
        act = self.act if self.act_kernel is None else self.act_kernel
        return self.tp.all_reduce(self.down_proj(act(self.gate_up_proj(x))))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, tp: TensorParallel):
        super().__init__()
        self.self_attn = SelfAttention(config, layer, tp)
        self.mlp = SparseMoE(config, tp) if config.is_moe_layer(layer) else GatedMLP(config, tp)
        self.input_layernorm = _norm(config)
        self.post_attention_layernorm = _norm(config)
        # Gemma 2's sandwich: attention's and the MLP's outputs are normalised before they join the residual.
        self.sandwich = config.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = _norm(config)
            self.post_feedforward_layernorm = _norm(config)

    def forward(self, rope, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        if not self.sandwich:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.rotary = RotaryEmbedding(config.rotary_dim or config.head_dim, config.max_position_embeddings,
                                      config.rope_theta, config.rope_scaling)
        self.embed_tokens = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size,
                                                                                     config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, i, tp) for i in range(config.num_layers))
        self.norm = _norm(config)
        self.cpu_decode = None  # models.cpu_decode_step.CpuDecodeStep, for decode-only steps on CPU

    def forward(self, x, positions, meta):
        step = self.cpu_decode
        if step is not None and step.applies(x, meta):
            return step(x, positions, meta)
        if step is not None and step.applies_to_decodes_of(meta):
            # A step with prefill chunks: its decodes (the first rows) through the C step, the
            # chunks through torch. They are other sequences, so nothing changes but the time
            # the decoding streams wait while a new prompt is prefilled.
            n = meta.num_decode_tokens
            decodes, prefills = split_decodes(meta)
            return torch.cat([step(x[:n], positions[:n], decodes), self._layers(x[n:], positions[n:], prefills)])
        return self._layers(x, positions, meta)

    def _layers(self, x, positions, meta):
        residual = None
        rope = self.rotary.lookup(positions, x.device)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class DecoderForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = config, tp
        self.local_config = local_config(config, tp.size)  # the shapes this rank holds
        self.model = DecoderModel(self.local_config, tp)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, tp)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        embed = self.lm_head.embed if self.model.embed_tokens is None else self.model.embed_tokens
        x = embed(input_ids)
        if self.config.embedding_scale is not None:
            # Gemma: the scale is a float32 constant rounded to the model's dtype, as in HF.
            x = x * torch.tensor(self.config.embedding_scale, dtype=torch.float32).to(x.dtype)
        return self.model(x, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def use_triton_kernels(self) -> None:
        """Fused Triton norm, rotary, SiLU-and-mul and MoE, to go with the Triton attention backend.

        Gemma's offset norms, Qwen3's q/k norms (strided head views) and GeGLU keep their torch code.
        """
        # Imported on use: CPU-only torch builds lack Triton.
        from kaon_runtime.kernels import activation, moe, norm, rotary
        plain_norm = self.config.norm_weight_offset == 0
        norms = [self.model.norm] + [n for layer in self.model.layers for n in
                                     (layer.input_layernorm, layer.post_attention_layernorm)]
        for n in norms if plain_norm and not self.config.sandwich_norms else []:
            n.kernel = norm.rms_norm
        for layer in self.model.layers:
            layer.self_attn.rotary_kernel = rotary.apply_rotary
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.kernel = moe.fused_moe
            elif self.config.hidden_act == "silu":
                layer.mlp.act_kernel = activation.silu_and_mul

    def use_cpu_decode_step(self) -> str | None:
        """Run decode-only steps through the fused C step (float32 on CPU, one rank); returns why
        not where it cannot (the model's options, or no C compiler), None when it is on."""
        reason = "tensor parallelism" if self.tp.size > 1 else unsupported(self.local_config)
        if reason is None and cpu_decode.library() is None:
            reason = "the C step could not be built (see the warning above)"
        if reason is None:
            step = CpuDecodeStep(self.model, self.local_config)
            try:
                step.check()
            except ValueError as exc:
                reason = str(exc)
            else:
                self.model.cpu_decode = step
                head = head_weights(self.lm_head)
                if head is not None:
                    self.lm_head.cpu_logits = functools.partial(cpu_decode.linear, head)
                    self.lm_head.cpu_logits_rows = MAX_ROWS
        return reason

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, each cut to this rank's shard as it streams by (so no rank
        ever holds the whole model), fusing q/k/v, gate/up and the experts; fails loudly on anything missing."""
        checkpoint_names.load(self, weights)

    def fuse_rows(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack HF-named per-output-row tensors the way load_weights fuses weights: q|k|v and
        gate|up along dim 0, keyed by parameter name. A fused group missing a part is left out."""
        return checkpoint_names.fuse_rows(tensors)
