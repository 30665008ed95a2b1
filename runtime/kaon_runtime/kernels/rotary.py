"""Triton rotary embedding in HF's split-halves layout. Reference: layers.rotary.apply_rotary.

Dimension i pairs with i + D/2 (not with its neighbour as in the interleaved GPT-J layout),
rotated by the angle of frequency i, in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_H = 16  # heads per program


@triton.jit
def _rotary_kernel(x_ptr, out_ptr, cos_ptr, sin_ptr, stride_xt, stride_xh, stride_ot, stride_oh, num_heads,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    token, head_block = tl.program_id(0), tl.program_id(1)
    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    cos = tl.load(cos_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    src = x_ptr + token * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    dtype = out_ptr.dtype.element_ty
    # Both halves are read before either is written, so out may be x itself.
    tl.store(dst, (x1 * cos - x2 * sin).to(dtype), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(dtype), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None):
    """x [T, heads, D] rotated by cos/sin ([T, D/2] or [T, 1, D/2], float32) into out (pass x for in place)."""
    tokens, heads, dim = x.shape
    half = dim // 2
    assert dim % 2 == 0 and x.stride(2) == 1, "head_dim must be even and contiguous"
    for table in (cos, sin):
        assert table.numel() == tokens * half and table.is_contiguous() and table.dtype == torch.float32
    out = torch.empty(tokens, heads, dim, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == x.shape and out.dtype == x.dtype and out.stride(2) == 1
    if tokens:
        _rotary_kernel[(tokens, triton.cdiv(heads, _BLOCK_H))](
            x, out, cos, sin, x.stride(0), x.stride(1), out.stride(0), out.stride(1), heads,
            HALF=half, BLOCK_H=_BLOCK_H, BLOCK_HALF=triton.next_power_of_2(half))
    return out


@triton.jit
def _rotate_heads(x_ptr, stride_xh, cos, sin, num_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    """Rotate the first 2 * HALF dims of num_heads heads at x_ptr in place; return the rotated halves (float32)."""
    heads = tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_HALF)
    mask = (heads[:, None] < num_heads) & (dims[None, :] < HALF)
    src = x_ptr + heads[:, None] * stride_xh + dims[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dtype = x_ptr.dtype.element_ty
    r1 = (x1 * cos - x2 * sin).to(dtype)
    r2 = (x2 * cos + x1 * sin).to(dtype)
    tl.store(src, r1, mask=mask)
    tl.store(src + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                            stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ch,
                            num_heads, num_kv_heads,
                            HALF: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr,
                            BLOCK_KV: tl.constexpr, BLOCK_HALF: tl.constexpr, TAIL: tl.constexpr,
                            BLOCK_TAIL: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0)
    dims = tl.arange(0, BLOCK_HALF)
    cos = tl.load(cos_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + token * HALF + dims, mask=dims < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr + token * stride_qt, stride_qh, cos, sin, num_heads, HALF, BLOCK_Q, BLOCK_HALF)
    k_src = k_ptr + token * stride_kt
    heads = tl.arange(0, BLOCK_KV)
    if TAIL:  # partial rotary: dims past 2 * HALF pass through; read before anything is written
        tail = tl.arange(0, BLOCK_TAIL)
        tail_mask = (heads[:, None] < num_kv_heads) & (tail[None, :] < TAIL)
        k_tail = tl.load(k_src + heads[:, None] * stride_kh + 2 * HALF + tail[None, :], mask=tail_mask)
    k1, k2 = _rotate_heads(k_src, stride_kh, cos, sin, num_kv_heads, HALF, BLOCK_KV, BLOCK_HALF)
    slot = tl.load(slot_ptr + token)  # int64: a slot times head_dim can pass 2**31 in a large pool
    if slot < 0:  # padding: q and k rotated, nothing cached
        return
    # The cached key is the rotated key as rounded to the cache dtype, exactly what write_kv_cache would copy.
    base = heads[:, None].to(tl.int64) * stride_ch + slot * HEAD_DIM
    half_mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < HALF)
    tl.store(k_cache_ptr + base + dims[None, :], k1, mask=half_mask)
    tl.store(k_cache_ptr + base + HALF + dims[None, :], k2, mask=half_mask)
    if TAIL:
        tl.store(k_cache_ptr + base + 2 * HALF + tail[None, :], k_tail, mask=tail_mask)
    full = tl.arange(0, BLOCK_D)
    full_mask = (heads[:, None] < num_kv_heads) & (full[None, :] < HEAD_DIM)
    value = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + full[None, :], mask=full_mask)
    tl.store(v_cache_ptr + base + full[None, :], value, mask=full_mask)


def rotary_write_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    rotary_dim: int | None = None) -> None:
    """apply_rotary on q and k in place, then write_kv_cache of the rotated k and of v, in one launch.

    q [T, H, D], k and v [T, Hkv, D] (strided views of a fused qkv, as the model hands them over);
    cos/sin as in apply_rotary, of width rotary_dim / 2 (None: the whole head; Phi-3's variants rotate
    a leading part). Slots < 0 are padding: rotated, not cached. Same arithmetic as the two kernels.
    """
    tokens, heads, dim = q.shape
    kv_heads = k.shape[1]
    rotary_dim = dim if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    assert rotary_dim % 2 == 0 and 0 < rotary_dim <= dim
    assert k.shape == v.shape == (tokens, kv_heads, dim) and slot_mapping.shape == (tokens,), "one slot per token"
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head_dim must be contiguous"
    for table in (cos, sin):
        assert table.numel() == tokens * half and table.is_contiguous() and table.dtype == torch.float32
    assert k_cache.shape == v_cache.shape and k_cache.shape[0] == kv_heads and k_cache.shape[3] == dim
    assert q.dtype == k.dtype == v.dtype == k_cache.dtype == v_cache.dtype, "no conversion on the way into the cache"
    assert slot_mapping.dtype == torch.int64 and k_cache.is_contiguous() and v_cache.is_contiguous()
    if tokens == 0:
        return
    tail = dim - rotary_dim
    _rotary_write_kv_kernel[(tokens,)](
        q, k, v, cos, sin, k_cache, v_cache, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), k_cache.stride(0), heads, kv_heads,
        HALF=half, HEAD_DIM=dim, BLOCK_Q=triton.next_power_of_2(heads), BLOCK_KV=triton.next_power_of_2(kv_heads),
        BLOCK_HALF=triton.next_power_of_2(half), TAIL=tail, BLOCK_TAIL=triton.next_power_of_2(max(tail, 1)),
        BLOCK_D=triton.next_power_of_2(dim),
        num_warps=4 if triton.next_power_of_2(heads) * triton.next_power_of_2(half) <= 2048 else 8)
