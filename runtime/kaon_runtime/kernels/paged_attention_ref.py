"""Pure-torch paged attention: the CPU backend and the reference for the Triton kernels.

The KV cache of one layer is a pool of slots, shape [num_slots, num_kv_heads, head_dim]
(num_slots = num_blocks * block_size). A token's slot is block_table[pos // B] * B + pos % B.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv_cache_ref(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> None:
    """Store each token's key/value at its slot; slots < 0 are padding and skipped."""
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    k_cache.index_copy_(0, slot_mapping, key)
    v_cache.index_copy_(0, slot_mapping, value)


def decode_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         gather_slots: torch.Tensor, key_mask: torch.Tensor, scale: float) -> torch.Tensor:
    """One query token per sequence against its cached context.

    query [B, H, D]; gather_slots [B, L] (slots of each context, padded); key_mask [B, L] True
    where the key exists. Returns [B, H, D].
    """
    batch, heads, dim = query.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[gather_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = v_cache[gather_slots].transpose(1, 2)
    q = query.view(batch, kv_heads, heads // kv_heads, dim)  # GQA: query heads grouped per kv head
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, L]
    scores.masked_fill_(~key_mask[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, Hkv, G, D]
    return out.reshape(batch, heads, dim)


def prefill_attention_ref(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          context_slots: torch.Tensor, scale: float) -> torch.Tensor:
    """A chunk of Q consecutive prompt tokens of one sequence, causal, over its whole context.

    query [Q, H, D] holds the last Q positions of a context of C = len(context_slots) tokens
    (the first C - Q come from earlier chunks or the prefix cache). Returns [Q, H, D].
    """
    num_q, heads, _ = query.shape
    kv_heads = k_cache.shape[1]
    keys = k_cache[context_slots].transpose(0, 1)  # [Hkv, C, D]
    values = v_cache[context_slots].transpose(0, 1)
    num_ctx = keys.shape[1]
    q = query.transpose(0, 1)  # [H, Q, D]
    if num_ctx == num_q:
        mask, causal = None, True
    else:  # bottom-right aligned causal mask: query i sits at position C - Q + i
        q_pos = torch.arange(num_ctx - num_q, num_ctx, device=query.device)
        mask = torch.arange(num_ctx, device=query.device)[None, :] <= q_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=causal, scale=scale,
                                         enable_gqa=heads != kv_heads)
    return out.transpose(0, 1)
