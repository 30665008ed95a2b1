"""The float64 kernels that compute each row alone (kernels/cpu_f64.py, cpu_decode.c kaon_linear_f64 /
kaon_attention_f64; layers/rows_alone.py): a row's outputs are the same bits alone, in any batch and at any padding of
its block table, and they are the float64 products and attention torch computes, to float64's rounding. The engine
built on them: tests/unit/runtime/engine/test_float64_invariance.py."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.kernels import cpu_f64, paged_attention_ref as ref
from kaon_runtime.kernels.moe_ref import moe_ref
from kaon_runtime.layers.activation import silu_and_mul
from kaon_runtime.layers.rows_alone import RowsAloneLinear, experts

pytestmark = pytest.mark.skipif(not cpu_f64.available(), reason="the C kernels are not built here")
F64 = torch.float64


@pytest.mark.parametrize("n,k", [(64, 576), (49, 37), (5, 3), (192, 64), (7, 1)])
@pytest.mark.parametrize("transposed", [False, True])
def test_a_rows_product_is_the_same_alone_and_in_any_batch(n, k, transposed):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g, dtype=F64)
    bias = None if transposed else torch.randn(n, generator=g, dtype=F64)
    x = torch.randn(37, k, generator=g, dtype=F64)
    weight = w.t().contiguous() if transposed else w
    whole = cpu_f64.linear(x, weight, bias, transposed)
    for rows in (1, 2, 3, 5, 17, 36):
        assert torch.equal(cpu_f64.linear(x[:rows], weight, bias, transposed), whole[:rows])
    for i in range(x.shape[0]):
        assert torch.equal(cpu_f64.linear(x[i:i + 1], weight, bias, transposed)[0], whole[i])
    expected = torch.nn.functional.linear(x, w, bias)
    assert torch.allclose(whole, expected, rtol=1e-13, atol=1e-13 * k)


def test_the_linear_takes_the_kernel_for_float64_and_torchs_product_otherwise():
    linear = RowsAloneLinear(40, 24).double()
    x = torch.randn(9, 3, 40, dtype=F64)
    out = linear(x)
    assert out.shape == (9, 3, 24)
    assert torch.equal(out.reshape(-1, 24), cpu_f64.linear(x.reshape(-1, 40), linear.weight, linear.bias))
    single = linear.float()
    assert torch.equal(single(x.float()), torch.nn.functional.linear(x.float(), single.weight, single.bias))


def _cache(g: torch.Generator, blocks: int = 24, block_size: int = 8, kv_heads: int = 2, dim: int = 16):
    k = torch.randn(kv_heads, blocks, block_size, dim, generator=g, dtype=F64)
    return k, torch.randn(k.shape, generator=g, dtype=F64)


@pytest.mark.parametrize("window,softcap", [(None, None), (13, None), (None, 5.0)])
def test_a_rows_attention_is_the_same_alone_and_beside_wider_rows(window, softcap):
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = _cache(g)
    rows, heads = 30, 4
    lens = torch.randint(1, 90, (rows,), generator=g)
    tables = torch.randint(0, 24, (rows, 12), generator=g)
    q = torch.randn(rows, heads, 16, generator=g, dtype=F64)
    whole = cpu_f64.attention(q, k_cache, v_cache, tables, lens, 0.25, window, softcap)
    for i in range(rows):
        own = tables[i:i + 1, :(int(lens[i]) + 7) // 8]  # only its own blocks
        assert torch.equal(cpu_f64.attention(q[i:i + 1], k_cache, v_cache, own, lens[i:i + 1], 0.25, window,
                                             softcap)[0], whole[i])
    keys = torch.arange(tables.shape[1] * 8)[None, :]
    mask = keys < lens[:, None]
    if window is not None:
        mask &= keys > lens[:, None] - 1 - window
    expected = ref.decode_attention_ref(q, k_cache, v_cache, tables, mask, 0.25, softcap=softcap)
    assert torch.allclose(whole, expected, rtol=1e-12, atol=1e-12)


def test_experts_rows_are_the_same_alone_and_batched():
    g = torch.Generator().manual_seed(5)
    x = torch.randn(21, 32, generator=g, dtype=F64)
    w13, w2 = torch.randn(4, 48, 32, generator=g, dtype=F64), torch.randn(4, 32, 24, generator=g, dtype=F64)
    weights = torch.rand(21, 2, generator=g, dtype=F64)
    ids = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(21)])
    whole = experts(x, w13, w2, weights, ids)
    for i in range(21):
        assert torch.equal(experts(x[i:i + 1], w13, w2, weights[i:i + 1], ids[i:i + 1])[0], whole[i])
    assert torch.allclose(whole, moe_ref(x, w13, w2, weights, ids, silu_and_mul), rtol=1e-12, atol=1e-12)
