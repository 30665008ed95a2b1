"""Pure-torch paged attention: the CPU backend and the reference for the Triton kernels.

One layer's cache is head-major: k_cache/v_cache [num_kv_heads, num_blocks, block_size, head_dim].
A token at position p of a sequence lives in block block_table[p // block_size] at offset
p % block_size; its flat slot is block * block_size + offset. Head-major blocks make a
sequence's gathered context contiguous per head, so attention runs on it without copies.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Elements of one kv head's slice of a layer's pool, at most: the Triton kernels address it with
# int32 offsets (fewer registers for their offset tiles than int64).
MAX_HEAD_SLICE = 2 ** 31 - 1


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store each token's key/value [T, Hkv, D] at its slot (in the cache's dtype); slots < 0 are
    padding and skipped."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    heads, _, _, dim = k_cache.shape
    k_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, key.transpose(0, 1).to(k_cache.dtype))
    v_cache.view(heads, -1, dim).index_copy_(1, slot_mapping, value.transpose(0, 1).to(v_cache.dtype))


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """cache [Hkv, N, B, D], block_ids [n] -> [Hkv, n * B, D] (into `out` when given: no allocation)."""
    heads, _, block_size, dim = cache.shape
    flat = cache.view(heads, -1, block_size * dim)
    if out is not None:
        out = out.view(heads, block_ids.numel(), block_size * dim)
    gathered = torch.index_select(flat, 1, block_ids, out=out) if out is not None else flat[:, block_ids]
    return gathered.view(heads, -1, dim)


def decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, key_mask: torch.Tensor, scale: float,
                         workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence against its cached context.

    query [S, H, D]; block_tables [S, M] (padded with any valid block id); key_mask
    [S, M * block_size], True for the positions each query sees: below its context length
    and, under a sliding window, within it. A cache narrower than the query (a float16 cache of a
    float32 model) is widened as gathered. Returns [S, H, D].
    """
    seqs, heads, dim = query.shape
    kv_heads, _, block_size, _ = k_cache.shape
    max_len = block_tables.shape[1] * block_size
    ids = block_tables.reshape(-1)
    k_ws, v_ws = workspace if workspace is not None else (None, None)
    keys = gather_blocks(k_cache, ids, k_ws).view(kv_heads, seqs, max_len, dim).to(query.dtype)
    values = gather_blocks(v_cache, ids, v_ws).view(kv_heads, seqs, max_len, dim).to(query.dtype)
    # GQA: the query heads that share a kv head form a group: [Hkv, S, G, D].
    q = query.view(seqs, kv_heads, heads // kv_heads, dim).transpose(0, 1)
    scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scale)  # [Hkv, S, G, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap).mul_(softcap)
    scores.masked_fill_(~key_mask[None, :, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [Hkv, S, G, D]
    return out.transpose(0, 1).reshape(seqs, heads, dim)


def prefill_attention_ref(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, block_table: torch.Tensor, context_len: int,
                          scale: float, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """A chunk of Q consecutive tokens of one sequence, causal, over its whole context.

    query [Q, H, D] and the chunk's own key/value [Q, Hkv, D] hold the last Q positions of
    a context of C tokens; the first C - Q (earlier chunks, prefix-cache hits) are read from
    the cache through block_table. With a sliding window, the query at position p sees keys
    p - window + 1 .. p only. Returns [Q, H, D].
    """
    num_q, heads, _ = query.shape
    kv_heads = k_cache.shape[0]
    q = query.transpose(0, 1)  # [H, Q, D]
    if context_len == num_q:  # nothing cached before the chunk: attend to it directly
        keys, values = key.transpose(0, 1), value.transpose(0, 1)
    else:
        keys = gather_blocks(k_cache, block_table)[:, :context_len].to(query.dtype)
        values = gather_blocks(v_cache, block_table)[:, :context_len].to(query.dtype)
    if window is None and softcap is None:
        if context_len == num_q:
            mask, causal = None, True
        else:
            mask, causal = _chunk_mask(num_q, context_len, None, query.device), False
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(0, 1)
    mask = _chunk_mask(num_q, context_len, window, query.device)
    if softcap is None:
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                             enable_gqa=heads != kv_heads)
        return out.transpose(0, 1)
    # SDPA has no soft-capping: scores by hand, with the query heads of a kv head as one group.
    group = heads // kv_heads
    scores = torch.matmul(q.reshape(kv_heads, group, num_q, -1), keys[:, None].transpose(-1, -2)).mul_(scale)
    scores = torch.tanh(scores / softcap).mul_(softcap)
    scores.masked_fill_(~mask, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values[:, None])  # [Hkv, G, Q, D]
    return out.reshape(heads, num_q, -1).transpose(0, 1)


def _chunk_mask(num_q: int, context_len: int, window: int | None, device) -> torch.Tensor:
    """[Q, C] True where query i (at position C - Q + i: bottom-right aligned) sees key j."""
    q_pos = torch.arange(context_len - num_q, context_len, device=device)[:, None]
    k_pos = torch.arange(context_len, device=device)[None, :]
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)
