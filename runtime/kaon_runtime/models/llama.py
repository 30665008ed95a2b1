"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over a flattened token batch.

Under tensor parallelism each rank builds the model with its share of the heads and of
the MLP width (`local_config`): q/k/v and gate/up are column-parallel, and the outputs of
o_proj and down_proj are partial sums that an all-reduce completes.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Iterable

import torch
from torch import nn

from kaon_runtime.config import ModelConfig
from kaon_runtime.distributed.parallel import TensorParallel
from kaon_runtime.distributed.sharding import cut, local_config
from kaon_runtime.layers.activation import silu_and_mul
from kaon_runtime.layers.attention import Attention, AttentionMetadata
from kaon_runtime.layers.norm import RMSNorm
from kaon_runtime.layers.rotary import RotaryEmbedding, apply_rotary
from kaon_runtime.layers.vocab import VocabEmbedding, VocabHead

# HF checkpoints keep q/k/v and gate/up apart; we fuse each group into one matmul.
_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        c = config
        self.tp = tp
        self.q_size, self.kv_size = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.qkv_proj = nn.Linear(c.hidden_size, self.q_size + 2 * self.kv_size, bias=c.attention_bias)
        self.o_proj = nn.Linear(self.q_size, c.hidden_size, bias=False)
        self.attn = Attention(c.num_heads, c.num_kv_heads, c.head_dim)
        self.rotary_kernel = None  # kernels.rotary.apply_rotary on the Triton backend

    def forward(self, rope, x, meta: AttentionMetadata):
        qkv = self.qkv_proj(x).view(x.shape[0], -1, self.head_dim)  # [T, H + 2 Hkv, D]
        rotated_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, :rotated_heads]  # q and k heads sit side by side: one pass
        if self.rotary_kernel is None:
            qk = apply_rotary(qk, *rope)
        else:
            qk = self.rotary_kernel(qk, *rope, out=qk)  # in place: q and k stay views of qkv, nothing copied
        q, k, v = qk[:, :self.num_heads], qk[:, self.num_heads:], qkv[:, rotated_heads:]
        out = self.attn(q, k, v, meta)
        return self.tp.all_reduce(self.o_proj(out.reshape(-1, self.q_size)))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_kernel = None  # kernels.activation.silu_and_mul on the Triton backend

    def forward(self, x):
        act = silu_and_mul if self.act_kernel is None else self.act_kernel
        return self.tp.all_reduce(self.down_proj(act(self.gate_up_proj(x))))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, tp)
        self.mlp = LlamaMLP(config, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, x, residual, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(rope, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling)
        self.embed_tokens = None if config.tie_word_embeddings else VocabEmbedding(config.vocab_size,
                                                                                     config.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, tp) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, meta):
        residual = None
        rope = self.rotary.lookup(positions, x.device)
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallel = TensorParallel()):
        super().__init__()
        self.config, self.tp = config, tp
        self.local_config = local_config(config, tp.size)  # the shapes this rank holds
        self.model = LlamaModel(self.local_config, tp)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, tp)

    def forward(self, input_ids, positions, meta: AttentionMetadata) -> torch.Tensor:
        embed = self.lm_head.embed if self.model.embed_tokens is None else self.model.embed_tokens
        return self.model(embed(input_ids), positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[Attention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def use_triton_kernels(self) -> None:
        """Fused Triton norm, rotary and SiLU-and-mul, to go with the Triton attention backend."""
        from kaon_runtime.kernels import activation, norm, rotary  # on use: CPU-only torch builds lack Triton
        self.model.norm.kernel = norm.rms_norm
        for layer in self.model.layers:
            layer.input_layernorm.kernel = layer.post_attention_layernorm.kernel = norm.rms_norm
            layer.self_attn.rotary_kernel = rotary.apply_rotary
            layer.mlp.act_kernel = activation.silu_and_mul

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, each cut to this rank's shard as it streams by (so no rank
        ever holds the whole model), fusing q/k/v and gate/up; fails loudly on anything missing."""
        params = dict(self.named_parameters())
        loaded = set()
        c = self.config
        tied = c.tie_word_embeddings
        for name, tensor in weights:
            if name == "lm_head.weight" and tied:
                continue  # some checkpoints store a copy of the tied weight anyway
            tensor = cut(name, tensor, c, self.tp.rank, self.tp.size)
            if name == "lm_head.weight" or (tied and name == "model.embed_tokens.weight"):
                name, tensor = "lm_head.weight_t", tensor.t()
            target, shard = _fused_target(name)
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in the model")
            param = params[target]
            if shard is None:
                _copy(param.data, tensor, name)
            else:
                sizes = _shard_sizes(target, self.local_config)
                start = sum(sizes[:shard])
                _copy(param.data.narrow(0, start, sizes[shard]), tensor, name)
            loaded.add((target, shard))
        expected = {(n, s) for n in params for s in _expected_shards(n)}
        missing = sorted(f"{n}[{s}]" if s is not None else n for n, s in expected - loaded)
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def fuse_rows(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """Stack HF-named per-output-row tensors the way load_weights fuses weights: q|k|v and
        gate|up along dim 0, keyed by parameter name. A fused group missing a part is left out."""
        parts = defaultdict(dict)
        for name, tensor in tensors:
            target, shard = _fused_target(name)
            parts[target][shard] = tensor
        return {target: torch.cat([shards[s] for s in _expected_shards(target)])
                for target, shards in parts.items() if set(shards) == set(_expected_shards(target))}


def _fused_target(name: str) -> tuple[str, int | None]:
    for part, (fused, shard) in _FUSED.items():
        if f".{part}." in name:
            return name.replace(part, fused), shard
    return name, None


def _shard_sizes(target: str, c: ModelConfig) -> list[int]:
    if "qkv_proj" in target:
        return [c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.num_kv_heads * c.head_dim]
    return [c.intermediate_size, c.intermediate_size]


def _expected_shards(name: str) -> list[int | None]:
    if "qkv_proj" in name:
        return [0, 1, 2]
    if "gate_up_proj" in name:
        return [0, 1]
    return [None]


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"tensor {name!r} has shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)
