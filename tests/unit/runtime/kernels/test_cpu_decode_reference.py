"""The fused C step's reference kinds (REF_INT8, REF_Q4, REF_Q8_G16, REF_Q8_G: cpu_decode.c) against the reference
arithmetic of weight-only checkpoints (kernels/quant_gemm_ref.py, quant/group_int8.py): float32 activations
times each weight dequantized to the same float32 value, only the summation order differing, one per row."""
from __future__ import annotations

import pytest
import torch
from test_cpu_decode import assert_rows_alone_equal_batched

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import dequantize_int4, pack_int4, w4a16_matmul_ref, w8a16_matmul_ref
from kaon_runtime.models.fused_weights import reference_weights
from kaon_runtime.quant.checkpoint_formats.loaded import grouped_weight
from kaon_runtime.quant.group_int8 import dequantize_group_int8
from kaon_runtime.quant.reference import use_reference_kernels


def assert_equal_up_to_summation_order(out: torch.Tensor, reference, x: torch.Tensor) -> None:
    """`out` against `reference(x)` (a linear map plus a bias, in torch) when both multiply the same float32
    weights by the same float32 inputs and only their summation order differs: two float32 sums of the same k
    products, each in its own order, differ by at most 2 k eps times the sum of the products' magnitudes (the
    standard bound), whatever the CPU's vector width.
    A fixed tolerance does not hold: an output near zero from large products (k = 256, random inputs) once missed
    1e-5 by a quarter. The reference's dense weights are read as its answers to one-hot inputs (exact: one
    product and zeros)."""
    k = x.shape[1]
    with torch.inference_mode():
        expected = reference(x)
        dense_t = reference(torch.eye(k)) - reference(torch.zeros(1, k))  # [k, n]: input i's weight to every output
        bound = 2 * k * torch.finfo(torch.float32).eps * (x.abs() @ dense_t.abs())
    over = (out - expected).abs() - bound
    assert (over <= 0).all(), f"{int((over > 0).sum())} outputs beyond float32 summation order, worst {over.max()}"


def _int4(n: int, k: int, group: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group, generator=g) * 0.02 + 0.001
    mins = -(torch.randint(0, 16, (n, k // group), generator=g).float()) * scales
    return pack_int4(q, group), scales, mins


@pytest.mark.parametrize("group", [32, 128, 16, 96])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_ref_q4_is_the_dequantized_weight_times_float32_inputs(group, rows, bias):
    n, k = 40, 384
    packed, scales, mins = _int4(n, k, group)
    b = torch.randn(n) if bias else None
    x = torch.randn(rows, k)
    weights = cpu_decode.LinearWeights.ref_q4(packed, scales, mins, group, b)
    bias = 0 if b is None else b
    assert_equal_up_to_summation_order(
        cpu_decode.linear(weights, x), lambda x: w4a16_matmul_ref(x, packed, scales, mins, group) + bias, x)
    assert_rows_alone_equal_batched(weights, x)


def test_ref_q4_widens_each_weight_to_the_references_float32_value():
    """One-hot inputs pick single weights: the products then need no sum, so they equal the reference exactly."""
    n, k, group = 16, 128, 32
    packed, scales, mins = _int4(n, k, group, seed=3)
    x = torch.eye(k)[:7]
    weights = cpu_decode.LinearWeights.ref_q4(packed, scales, mins, group)
    assert torch.equal(cpu_decode.linear(weights, x), dequantize_int4(packed, scales, mins, group)[:, :7].t())


def test_ref_int8_is_the_integer_sum_times_the_row_scale():
    g = torch.Generator().manual_seed(1)
    n, k = 24, 256
    qweight = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) * 0.01
    b = torch.randn(n, generator=g)
    x = torch.randn(5, k, generator=g)
    weights = cpu_decode.LinearWeights.ref_int8(qweight, scales, b)
    assert_equal_up_to_summation_order(
        cpu_decode.linear(weights, x), lambda x: w8a16_matmul_ref(x, qweight, scales) + b, x)
    assert_rows_alone_equal_batched(weights, x)


def _loaded(bits: int, group: int, act_order: bool, asymmetric: bool, n: int = 40, k: int = 256, seed: int = 2):
    """A checkpoint's weight as the loader holds it on CPU (grouped_weight, then its module), reference set."""
    g = torch.Generator().manual_seed(seed)
    groups = k // group
    q = torch.randint(0, 1 << bits, (n, k), generator=g)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    mid = float(1 << (bits - 1))
    zeros = torch.randint(0, 1 << bits, (n, groups), generator=g).float() if asymmetric else torch.full_like(scales,
                                                                                                          mid)
    g_idx = torch.randperm(k, generator=g) // group if act_order else None
    loaded = grouped_weight("layer", q, scales, zeros, bits, g_idx)
    module = loaded.to_module(torch.randn(n, generator=g), torch.device("cpu"))
    use_reference_kernels(module)
    return module


@pytest.mark.parametrize("bits,group,asymmetric", [(4, 128, False), (4, 32, True), (8, 64, True), (8, 256, True),
                                                   (8, 256, False)])
@pytest.mark.parametrize("act_order", [False, True])
def test_a_loaded_checkpoint_weight_takes_its_reference_kind(bits, group, asymmetric, act_order):
    """GPTQ / AWQ / compressed-tensors weights as held after load, act-order included: the C step's kind equals
    the module's own reference arithmetic (torch) within float32 summation order, rows alone as batched."""
    module = _loaded(bits, group, act_order, asymmetric)
    weights = reference_weights(module)
    assert weights is not None and weights.struct.kind in cpu_decode.REFERENCE_KINDS
    x = torch.randn(6, module.in_features)
    assert_equal_up_to_summation_order(cpu_decode.linear(weights, x), module, x)
    assert_rows_alone_equal_batched(weights, x)


def test_group_int8_is_read_from_its_kernel_layout_as_dequantize_group_int8_values():
    module = _loaded(8, 64, act_order=False, asymmetric=True)
    weights = reference_weights(module)
    assert weights is not None and weights.struct.kind == cpu_decode.KIND_REF_Q8_G16
    x = torch.eye(module.in_features)[:9]
    dense = dequantize_group_int8(module.weight)
    assert torch.equal(cpu_decode.linear(weights, x), dense[:, :9].t() + module.bias)


@pytest.mark.parametrize("group,k", [(8, 256), (24, 120), (40, 120), (40, 40), (12, 36)])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_8bit_groups_that_are_not_multiples_of_16_take_ref_q8_g(group, k, act_order, asymmetric):
    """GPTQ / compressed-tensors 8-bit in groups Q8_G16 cannot hold (8, 24, 40: not a multiple of 16; one group of
    40 or 36 is an asymmetric per-channel weight at such a K): read in place as the module holds them (REF_Q8_G),
    equal to the module's own reference arithmetic (torch: x @ dequantize_group_int8(w).t() in float32) within
    float32 summation order, each row alone as batched; before, the blocker kept them on torch's path."""
    module = _loaded(8, group, act_order, asymmetric, k=k)
    weights = reference_weights(module)
    per_channel_int8 = group == k and not asymmetric  # (zero points all 128: plain int8, REF_INT8)
    assert weights is not None
    assert weights.struct.kind == (cpu_decode.KIND_REF_INT8 if per_channel_int8 else cpu_decode.KIND_REF_Q8_G)
    x = torch.randn(6, k)
    assert_equal_up_to_summation_order(cpu_decode.linear(weights, x), module, x)
    assert_rows_alone_equal_batched(weights, x)


@pytest.mark.parametrize("asymmetric", [False, True])
def test_ref_q8_g_widens_each_weight_to_dequantize_group_int8s_value(asymmetric):
    """One-hot inputs pick single weights (no sum): each equals its dequantize_group_int8 value exactly."""
    module = _loaded(8, 24, act_order=False, asymmetric=asymmetric, k=120)
    weights = reference_weights(module)
    assert weights is not None and weights.struct.kind == cpu_decode.KIND_REF_Q8_G
    x = torch.eye(module.in_features)
    dense = dequantize_group_int8(module.weight)
    assert torch.equal(cpu_decode.linear(weights, x), dense.t() + module.bias)


def test_without_the_reference_mark_the_default_kinds_stay():
    module = _loaded(4, 128, act_order=False, asymmetric=False)
    module.reference = False
    assert reference_weights(module) is None
