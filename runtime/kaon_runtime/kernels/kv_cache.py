"""Triton kernel storing each new token's key/value at its slot of the head-major paged cache.

Reference: paged_attention_ref.write_kv_cache_ref (same layout, same padding convention).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_ch,
                     num_heads, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)  # int64: a slot times head_dim can pass 2**31 in a large pool
    if slot < 0:  # padding
        return
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HEAD_DIM)
    src_key = key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :]
    src_value = value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :]
    dst = heads[:, None].to(tl.int64) * stride_ch + slot * HEAD_DIM + dims[None, :]
    tl.store(k_cache_ptr + dst, tl.load(src_key, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(src_value, mask=mask), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """key/value [T, Hkv, D] (rows may be strided views of a fused qkv) -> their slots; slots < 0 are skipped."""
    tokens, heads, dim = key.shape
    assert value.shape == key.shape and slot_mapping.shape == (tokens,), "one slot per token"
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] == heads and k_cache.shape[3] == dim
    assert key.dtype == value.dtype == k_cache.dtype == v_cache.dtype, "no conversion on the way into the cache"
    assert slot_mapping.dtype == torch.int64
    assert key.stride(2) == 1 and value.stride(2) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous()
    if tokens == 0:
        return
    _write_kv_kernel[(tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1), k_cache.stride(0),
        heads, HEAD_DIM=dim, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(dim))
