"""Attention over the paged KV cache, behind one interface whatever the backend.

The model runner builds one AttentionMetadata per step; every layer reuses it. Tokens in
the flattened batch are ordered decodes first (one query token each), then prefill chunks.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
from torch import nn

from kaon_runtime.kernels import paged_attention_ref as ref


@dataclass(slots=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the flattened batch
    query_len: int
    context_slots: torch.Tensor  # [context_len] slots of every key the chunk attends to


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_slots: torch.Tensor | None = None  # [B, L] context slots per decode sequence, padded
    decode_key_mask: torch.Tensor | None = None  # [B, L] True where a real key sits
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] for kernels that walk blocks
    context_lens: torch.Tensor | None = None  # [num_seqs]
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttentionBackend:
    """Gathers each sequence's context from the pool; runs on any device."""

    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ref.write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = ref.decode_attention_ref(q[:n], k_cache, v_cache, meta.decode_slots, meta.decode_key_mask,
                                               scale)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = ref.prefill_attention_ref(q[rows], k_cache, v_cache, chunk.context_slots, scale)
        return out


_BACKENDS = {"torch": TorchAttentionBackend}


def select_backend(device: torch.device):
    """KAON_ATTENTION_BACKEND overrides; the Triton kernels join this table in their own change."""
    name = os.environ.get("KAON_ATTENTION_BACKEND", "torch")
    if name not in _BACKENDS:
        raise ValueError(f"unknown KAON_ATTENTION_BACKEND {name!r}; available: {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


class Attention(nn.Module):
    """Multi-head attention core (after projections and rotary). The runner attaches the caches."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.k_cache: torch.Tensor | None = None  # [num_slots, Hkv, D]
        self.v_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
