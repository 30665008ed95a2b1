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
    # [S, M * block_size] True where a real key sits; the torch backend builds it on first use
    decode_key_mask: torch.Tensor | None = None
    # the same, limited to each sliding window that layers use, by window size (torch backend)
    decode_window_masks: dict[int, torch.Tensor] = field(default_factory=dict)
    prefills: list[PrefillChunk] = field(default_factory=list)

    def decodes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The decode rows' block tables and context lengths (a step with decodes has both)."""
        assert self.decode_block_tables is not None and self.decode_context_lens is not None
        return self.decode_block_tables, self.decode_context_lens


def as_decode_rows(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """Every row of a step as a decode row: (block tables [T, M], padded with block 0; context lengths [T]).
    A chunk's token i sees the chunk's context up to itself: context_len - query_len + i + 1 tokens. (The fused CPU
    step's rows and the float64 rows of layers/rows_alone.py: a prompt row computes as a decode row does.)"""
    tables, lens = [], []
    if meta.num_decode_tokens:
        decode_tables, decode_lens = meta.decodes()
        tables += list(decode_tables)
        lens.append(decode_lens.to(torch.int64))
    for chunk in meta.prefills:
        first = chunk.context_len - chunk.query_len + 1
        lens.append(torch.arange(first, first + chunk.query_len, dtype=torch.int64))
        tables += [chunk.block_table] * chunk.query_len
    padded = nn.utils.rnn.pad_sequence([t.to(torch.int64) for t in tables], batch_first=True)
    return padded, torch.cat(lens)


class TorchAttentionBackend:
    """Gathers each sequence's context from the pool; runs on any device.

    The gathered decode context is large (batch x longest context per layer), so it lands
    in workspace buffers that are reused across layers and steps instead of fresh memory.
    """

    name = "torch"
    fuses_rotary = False  # the model rotates q and k before forward

    def __init__(self):
        self._workspace: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        ref.write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        n = meta.num_decode_tokens
        decoded = None
        if n:
            tables, _ = meta.decodes()
            workspace = self._workspace_for(k_cache, tables.numel())
            decoded = ref.decode_attention_ref(q[:n], k_cache, v_cache, tables,
                                               self._decode_mask(meta, k_cache.shape[2], window), scale, workspace,
                                               softcap)
            if not meta.prefills:
                return decoded
        out = torch.empty_like(q)
        if decoded is not None:
            out[:n] = decoded
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = ref.prefill_attention_ref(q[rows], k[rows], v[rows], k_cache, v_cache, chunk.block_table,
                                                  chunk.context_len, scale, window, softcap)
        return out

    @staticmethod
    def _decode_mask(meta: AttentionMetadata, block_size: int, window: int | None) -> torch.Tensor:
        """Built once per step and window: every layer gets the same metadata."""
        tables, lens = meta.decodes()
        if meta.decode_key_mask is None:
            keys = torch.arange(tables.shape[1] * block_size, device=lens.device)
            meta.decode_key_mask = keys[None, :] < lens[:, None]
        if window is None:
            return meta.decode_key_mask
        if window not in meta.decode_window_masks:
            keys = torch.arange(meta.decode_key_mask.shape[1], device=meta.decode_key_mask.device)
            newest = lens[:, None] - 1
            meta.decode_window_masks[window] = meta.decode_key_mask & (keys[None, :] > newest - window)
        return meta.decode_window_masks[window]

    def _workspace_for(self, cache: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        heads, _, block_size, dim = cache.shape
        size = heads * num_blocks * block_size * dim
        if self._workspace is None or self._workspace[0].numel() < size or self._workspace[0].dtype != cache.dtype:
            self._workspace = (torch.empty(size, dtype=cache.dtype, device=cache.device),
                               torch.empty(size, dtype=cache.dtype, device=cache.device))
        return self._workspace[0][:size], self._workspace[1][:size]


# The prefill chunks as the Triton kernel takes them: block tables, query starts and lengths,
# context lengths, the longest query.
_PackedPrefills = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]


class TritonAttentionBackend:
    """Triton kernels read the context straight from the pool's blocks: no gathered copies.

    batch_invariant (issue 49 §2, KAON_GPU_BATCH_INVARIANT=1): a row's attention does not depend on the
    step. One token can be a decode row in one run and a prefill row in another (a one-token prompt chunk
    after a prefix-cache hit or a chunk boundary goes to the decode kernel; a generated token recomputed
    after preemption, or verified beside drafts, goes to the prefill kernel), and the split decode kernel
    cannot give the prefill kernel's bits (its partitions are merged, its tiles are another shape). So
    every row takes the prefill kernel, decode rows as chunks of one (paged_attention.prefill_attention,
    `invariant`); the split decode kernel is not used.
    """

    name = "triton"
    # forward takes the step's rotary tables and rotates q and k in the launch that caches k and v
    # (kernels.rotary.rotary_write_kv): one small kernel a layer fewer than rotary, then the write.
    fuses_rotary = True

    def __init__(self, batch_invariant: bool = False):
        # Imported on use: CPU-only torch builds ship without Triton, and the torch backend must not need it.
        from kaon_runtime.kernels import kv_cache, paged_attention, rotary
        self._write_kv_cache = kv_cache.write_kv_cache
        self._rotary_write_kv = rotary.rotary_write_kv
        self._kernels = paged_attention
        self.batch_invariant = batch_invariant
        self._packed: tuple[AttentionMetadata, _PackedPrefills] | None = None
        self._decode_chunks: tuple[AttentionMetadata, _PackedPrefills] | None = None

    def forward(self, q, k, v, k_cache, v_cache, meta: AttentionMetadata, scale: float,
                window: int | None = None, softcap: float | None = None,
                rope: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
        """rope: (cos, sin, rotary_dim) to rotate q and k (in place) first; None: they come rotated."""
        if rope is None:
            self._write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self._rotary_write_kv(q, k, v, *rope[:2], k_cache, v_cache, meta.slot_mapping, rope[2])
        out = q.new_empty(q.shape)
        n = meta.num_decode_tokens
        invariant = self.batch_invariant
        if n and invariant:
            tables, starts, query_lens, context_lens, _ = self._decodes_as_chunks(meta)
            self._kernels.prefill_attention(q, k_cache, v_cache, tables, starts, query_lens, context_lens, 1, scale,
                                            out, window=window, softcap=softcap, invariant=True)
        elif n:
            tables, lens = meta.decodes()
            self._kernels.decode_attention(q[:n], k_cache, v_cache, tables, lens, scale, out[:n], window=window,
                                           softcap=softcap)
        if meta.prefills:
            tables, starts, query_lens, context_lens, max_query_len = self._packed_prefills(meta)
            self._kernels.prefill_attention(q, k_cache, v_cache, tables, starts, query_lens, context_lens,
                                            max_query_len, scale, out, window=window, softcap=softcap,
                                            invariant=invariant)
        return out

    def _decodes_as_chunks(self, meta: AttentionMetadata) -> _PackedPrefills:
        """The decode rows as prefill chunks of one token (row i: query i, its whole context); built once per
        step on the device, from device tensors only, so a CUDA graph of a decode step records it."""
        if self._decode_chunks is None or self._decode_chunks[0] is not meta:
            tables, lens = meta.decodes()
            starts = torch.arange(lens.shape[0], device=lens.device)
            self._decode_chunks = meta, (tables, starts, torch.ones_like(starts), lens.contiguous(), 1)
        return self._decode_chunks[1]

    def _packed_prefills(self, meta: AttentionMetadata) -> _PackedPrefills:
        """The chunks as kernel arguments; built once per step, since every layer gets the same metadata."""
        if self._packed is None or self._packed[0] is not meta:
            chunks = meta.prefills
            tables = nn.utils.rnn.pad_sequence([c.block_table for c in chunks], batch_first=True)
            starts, lens, context_lens = torch.tensor(
                [[c.query_start for c in chunks], [c.query_len for c in chunks], [c.context_len for c in chunks]],
                dtype=torch.long, device=tables.device)
            self._packed = meta, (tables, starts, lens, context_lens, max(c.query_len for c in chunks))
        return self._packed[1]


_BACKENDS = {"torch": TorchAttentionBackend, "triton": TritonAttentionBackend}


def backend_name(device: torch.device) -> str:
    """KAON_ATTENTION_BACKEND overrides; otherwise Triton on CUDA devices and torch elsewhere."""
    name = os.environ.get("KAON_ATTENTION_BACKEND", "triton" if device.type == "cuda" else "torch")
    if name not in _BACKENDS:
        raise ValueError(f"unknown KAON_ATTENTION_BACKEND {name!r}; available: {sorted(_BACKENDS)}")
    if name == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") == "0":
        raise ValueError("the triton attention backend needs a CUDA device, or TRITON_INTERPRET=1 to run its "
                         "kernels in Triton's interpreter")
    return name


def select_backend(device: torch.device):
    """A new instance of the backend `backend_name` picks."""
    return _BACKENDS[backend_name(device)]()


class Attention(nn.Module):
    """Multi-head attention core (after projections and rotary), through the backend it is built
    with. The runner attaches the caches once it has sized the pool.

    sliding_window: a query sees itself and the window - 1 keys before it (older keys stay in
    the cache but are masked). softcap: scores become softcap * tanh(scores / softcap) (Gemma 2).
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None,
                 sliding_window: int | None = None, softcap: float | None = None, backend=None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.sliding_window, self.softcap = sliding_window, softcap
        self.k_cache: torch.Tensor | None = None  # [Hkv, num_blocks, block_size, D]
        self.v_cache: torch.Tensor | None = None
        self.backend = backend if backend is not None else TorchAttentionBackend()

    def forward(self, q, k, v, meta: AttentionMetadata, rope=None) -> torch.Tensor:
        """rope: (cos, sin, rotary_dim) for a backend that `fuses_rotary`; q and k come unrotated then."""
        extra = {} if rope is None else {"rope": rope}
        return self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta, self.scale, self.sliding_window,
                                    self.softcap, **extra)
