"""Triton kernels against their pure-torch references (through Triton's interpreter when there is no GPU)."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.kernels import activation, norm, rotary
from kaon_runtime.kernels.kv_cache import write_kv_cache
from kaon_runtime.kernels.paged_attention_ref import write_kv_cache_ref
from kaon_runtime.layers.activation import silu_and_mul
from kaon_runtime.layers.norm import RMSNorm
from kaon_runtime.layers.rotary import RotaryEmbedding, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
# Bit-exact on a GPU; the interpreter truncates float32 -> bfloat16 where GPUs round to nearest: one ulp.
SAME_ROUNDING = dict(rtol=0, atol=0) if DEVICE == "cuda" else dict(rtol=2 ** -7, atol=0)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 256])
def test_rms_norm_matches_reference(dtype, hidden):
    torch.manual_seed(0)
    layer = RMSNorm(hidden, eps=1e-5).to(device=DEVICE, dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_()
    # Transposed rows, as the tied embedding hands the first layer its input.
    x = _randn(hidden, 7, dtype=dtype).t()
    residual = _randn(7, hidden, dtype=dtype)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(norm.rms_norm(x, layer.weight, layer.eps), layer(x), **close)
    out, new_residual = norm.rms_norm(x, layer.weight, layer.eps, residual)
    torch.testing.assert_close(new_residual, layer(x, residual)[1], **SAME_ROUNDING)
    torch.testing.assert_close(out, layer(new_residual), **close)  # normed from the sum the kernel made


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_in_and_out_of_place(dtype):
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 14, 6, 32  # 20 rotated heads: two programs per token, the second half empty
    rope = RotaryEmbedding(head_dim, max_positions=4096, base=10000.0)
    cos, sin = rope.lookup(torch.tensor([0, 1, 17, 300, 4095], device=DEVICE), torch.device(DEVICE))
    qkv = _randn(5, heads + 2 * kv_heads, head_dim, dtype=dtype)
    qk, untouched = qkv[:, :heads + kv_heads], qkv[:, heads + kv_heads:].clone()
    expected = apply_rotary(qk, cos, sin)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(rotary.apply_rotary(qk, cos, sin), expected, **close)
    assert rotary.apply_rotary(qk, cos, sin, out=qk) is qk
    torch.testing.assert_close(qk, expected, **close)
    torch.testing.assert_close(qkv[:, heads + kv_heads:], untouched, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim", [(14, 6, 32, None), (4, 1, 48, 16), (8, 8, 16, None)])
def test_rotary_write_kv_equals_rotary_then_write_kv(dtype, heads, kv_heads, head_dim, rotary_dim):
    """The fused launch gives the two kernels' results bit for bit, and the pure-torch references' as closely
    as rotary alone does: q and k rotated in place (partial rotary leaves the rest of each head alone),
    the rotated k and v at their slots, padding rows uncached."""
    torch.manual_seed(0)
    rotary_dim = rotary_dim or head_dim
    rope = RotaryEmbedding(rotary_dim, max_positions=4096, base=10000.0)
    slots = torch.tensor([3, 4, -1, 7, 19], device=DEVICE)
    cos, sin = rope.lookup(torch.tensor([0, 1, 17, 300, 4095], device=DEVICE), torch.device(DEVICE))
    qkv = _randn(len(slots), heads + 2 * kv_heads, head_dim, dtype=dtype)
    caches = [_randn(kv_heads, 5, 4, head_dim, dtype=dtype) for _ in range(2)]
    references = {}
    for name, rotate, write in (("torch", apply_rotary, write_kv_cache_ref),
                                ("kernels", rotary.apply_rotary, write_kv_cache)):
        expected_qkv, expected_caches = qkv.clone(), [c.clone() for c in caches]
        rotated = expected_qkv[:, :heads + kv_heads, :rotary_dim]
        rotated.copy_(rotate(rotated, cos, sin))
        write(expected_qkv[:, heads:heads + kv_heads], expected_qkv[:, heads + kv_heads:], *expected_caches, slots)
        references[name] = [expected_qkv, *expected_caches]
    rotary.rotary_write_kv(qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:], cos, sin,
                           *caches, slots, rotary_dim)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    for got, by_torch, by_kernels in zip([qkv, *caches], references["torch"], references["kernels"]):
        torch.testing.assert_close(got, by_kernels, rtol=0, atol=0)
        torch.testing.assert_close(got, by_torch, **close)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [40, 1500])
def test_silu_and_mul_matches_reference(dtype, intermediate):
    torch.manual_seed(0)
    x = _randn(3, 2 * intermediate, dtype=dtype) * 4
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else {}
    torch.testing.assert_close(activation.silu_and_mul(x), silu_and_mul(x), **close)


# ---- fused mixture of experts ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,experts,top_k,renormalize", [(1, 4, 2, True), (37, 8, 2, False), (70, 5, 3, True)])
def test_fused_moe_matches_reference(dtype, tokens, experts, top_k, renormalize):
    """Random routing over experts of uneven popularity (some get no token), against the per-expert torch loop."""
    from kaon_runtime.kernels.moe import fused_moe
    from kaon_runtime.kernels.moe_ref import moe_ref, route
    torch.manual_seed(0)
    hidden, width = 64, 48  # the width is not a multiple of the kernel's column tile
    x = _randn(tokens, hidden, dtype=dtype)
    w13 = (_randn(experts, 2 * width, hidden) * hidden ** -0.5).to(dtype)
    w2 = (_randn(experts, hidden, width) * width ** -0.5).to(dtype)
    logits = _randn(tokens, experts) + torch.linspace(0, 3, experts, device=DEVICE)  # popular last experts
    weights, ids = route(logits, top_k, renormalize)
    assert torch.allclose(weights.sum(-1), torch.ones(tokens, device=DEVICE)) == renormalize
    weights = weights.to(dtype)
    expected = moe_ref(x, w13, w2, weights, ids, silu_and_mul)
    close = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), expected, **close)


def test_moe_alignment_groups_rows_by_expert_in_padded_blocks():
    from kaon_runtime.kernels.moe import align_by_expert
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]], device=DEVICE)  # rows 0..5 = token * 2 + slot
    sorted_ids, block_experts = align_by_expert(ids, num_experts=4, block_m=4)
    pad = 6
    assert sorted_ids.tolist()[:12] == [1, 4, pad, pad, 3, pad, pad, pad, 0, 2, 5, pad]
    assert block_experts.tolist()[:3] == [0, 1, 2] and set(block_experts.tolist()[3:]) <= {4}


def test_route_takes_the_top_k_of_the_softmax():
    from kaon_runtime.kernels.moe_ref import route
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[1, 2]] and torch.allclose(weights[0], probs[[1, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    assert torch.allclose(weights[0], probs[[1, 2]] / probs[[1, 2]].sum())
