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
    context_len: int  # tokens the chunk attends to, its own included
    block_table: torch.Tensor  # [ceil(context_len / block_size)] blocks holding that context


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [S, M] per decode sequence, padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [S]
    decode_key_mask: torch.Tensor | None = None  # [S, M * block_size] True where a real key sits
    prefills: list[PrefillChunk] = field(default_factory=list)


class TorchAttentionBackend:
    """Gathers each sequence's context from the pool; runs on any device.

    The gathered decode context is large (batch x longest context per layer), so it lands
    in workspace buffers that are reused across layers and steps instead of fresh memory.
    """

    name = "torch"

    def __init__(self):
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        ref.write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        n = meta.num_decode_tokens
        decoded = None
        if n:
            workspace = self._workspace_for(k_cache, meta.decode_block_tables.numel())
            decoded = ref.decode_attention_ref(q[:n], k_cache, v_cache, meta.decode_block_tables,
                                               meta.decode_key_mask, scale, workspace)
            if not meta.prefills:
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:n] = decoded
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = ref.prefill_attention_ref(q[rows], k[rows], v[rows], k_cache, v_cache, chunk.block_table,
                                                  chunk.context_len, scale)
        return out

    def _workspace_for(self, cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        heads, _, block_size, dim = cache.shape
        size = heads * num_blocks * block_size * dim
        if self._workspace is None or self._workspace[0].numel() < size or self._workspace[0].dtype != cache.dtype:
            self._workspace = tuple(torch.empty(size, dtype=cache.dtype, device=cache.device) for _ in range(2))
        return self._workspace[0][:size], self._workspace[1][:size]


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
        self.k_cache: torch.Tensor | None = None  # [Hkv, num_blocks, block_size, D]
        self.v_cache: torch.Tensor | None = None
        self.backend = None

    def forward(self, q, k, v, meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale)
