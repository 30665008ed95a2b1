"""Triton kernels against their pure-torch references (through Triton's interpreter when there is no GPU)."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.kernels.kv_cache import write_kv_cache
from kaon_runtime.kernels.paged_attention_ref import write_kv_cache_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _randn(*shape, dtype=torch.float32):
    return torch.randn(*shape, device=DEVICE).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kv_heads,head_dim", [(1, 16), (3, 24)])
def test_write_kv_cache_matches_reference(dtype, kv_heads, head_dim):
    num_blocks, block_size = 5, 4
    # Slots on both sides of block boundaries, a padding slot (-1) in the middle, the pool's last slot.
    slots = torch.tensor([3, 4, -1, 7, 8, 0, 19], device=DEVICE)
    # Keys as a strided view of a fused qkv row, the way the model hands them over.
    qkv = _randn(len(slots), 2 + 2 * kv_heads, head_dim, dtype=dtype)
    key, value = qkv[:, 2:2 + kv_heads], qkv[:, 2 + kv_heads:]
    caches = [_randn(kv_heads, num_blocks, block_size, head_dim, dtype=dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    write_kv_cache_ref(key, value, *expected, slots)
    write_kv_cache(key, value, *caches, slots)
    torch.testing.assert_close(caches[0], expected[0], rtol=0, atol=0)
    torch.testing.assert_close(caches[1], expected[1], rtol=0, atol=0)


def test_write_kv_cache_rejects_a_wrong_dtype():
    key = _randn(2, 1, 16)
    cache = _randn(1, 2, 4, 16, dtype=torch.bfloat16)
    with pytest.raises(AssertionError, match="conversion"):
        write_kv_cache(key, key, cache, cache.clone(), torch.tensor([0, 1], device=DEVICE))
