"""W8A8 int8 in the fused CPU step (cpu_decode.c, kind INT8_A8; issue 49 §2).

compressed-tensors W8A8 int8 with dynamic per-token activations is computed on torch's path by
quant/dynamic_inputs.py: each input row quantized to int8 (scale max |x| / 127.5, round half to even),
int8 x int8 summed exactly in int32, then times the row's and the output's scales. The C kind computes
the same per row: the integer sums are exact, so its outputs equal torch's bit for bit and a row's
numbers cannot depend on its neighbours, prefill chunks or prefix-cache hits. Here: the kernel against
torch's reference (bit for bit), the rounding's ties, a row alone against batched, a whole step against
torch's path, and a prompt's rows chunked / cached / beside decodes / in pieces."""
from __future__ import annotations

import pytest
import test_cpu_decode_invariance as invariance
import torch
from test_cpu_decode import assert_rows_alone_equal_batched, c_step_error_against_torch, random_model, tiny_config

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.models.cpu_decode_step import blocker
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.dynamic_inputs import DynamicInt8Linear, quantize_per_token, w8a8_reference
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8
from kaon_runtime.quant.static_inputs import StaticInputLinear, round_to_grid

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_the_w8a8_projection_equals_torchs_bit_for_bit(rows, bias):
    """Against w8a8_reference and DynamicInt8Linear (the torch path): equal, not close. K = 104: the
    16-wide loop and a tail; rows spanning four decades, so the per-token scales differ."""
    torch.manual_seed(0)
    q, scales = quantize_int8(torch.randn(84, 104))
    b = torch.randn(84) if bias else None
    x = torch.randn(rows, 104) * torch.logspace(-3, 1, 104)
    out = cpu_decode.linear(cpu_decode.LinearWeights.int8_a8(q, scales, b), x)
    expected = w8a8_reference(x, q, scales)
    if bias:
        expected += b
    assert torch.equal(out, expected)
    with torch.inference_mode():
        assert torch.equal(out, DynamicInt8Linear(q, scales.float(), b)(x))


def test_the_inputs_are_quantized_per_token_as_torch_quantizes_them():
    """An identity weight passes q * scale through: quantize_per_token's, ties included (a row whose max is
    127.5 has scale 1, so x.5 values are halfway: to even, -127.5 to -128, 127.5 clamped to 127), a zero
    row (float32's eps as its scale) and a constant row."""
    torch.manual_seed(1)
    x = torch.randn(5, 64) * torch.logspace(-6, 2, 64)
    x[2] = 0
    x[3] = 3.0
    x[4] = 0
    x[4, :10] = torch.tensor([127.5, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -127.5, 3.4999998, -0.49999997])
    identity = cpu_decode.LinearWeights.int8_a8(torch.eye(64, dtype=torch.int8), torch.ones(64))
    q, scale = quantize_per_token(x)
    assert torch.equal(cpu_decode.linear(identity, x), q.float() * scale)
    assert q[4, :10].tolist() == [127, 0, 2, 2, 0, -2, 126, -128, 3, 0]


def test_the_int32_sums_are_exact_at_their_largest():
    """Products of 127 x 127 (odd) over K = 4104: partial sums past 2^24, where a float32 accumulation would
    round (the exact sum, 66,193,416, is a float32; its halves are not)."""
    k = 4104
    w = torch.full((8, k), 127, dtype=torch.int8)
    x = torch.ones(2, k)  # x / scale = 127.5, clamped to 127
    out = cpu_decode.linear(cpu_decode.LinearWeights.int8_a8(w, torch.ones(8)), x)
    assert torch.equal(out, w8a8_reference(x, w, torch.ones(8)))


def test_a_w8a8_row_gets_the_same_bits_alone_or_in_a_batch():
    torch.manual_seed(7)
    q, scales = quantize_int8(torch.randn(40, 104))
    weights = cpu_decode.LinearWeights.int8_a8(q, scales, torch.randn(40))
    assert_rows_alone_equal_batched(weights, torch.randn(13, 104))


def _w8a8_model(model) -> None:
    """Every projection as a compressed-tensors W8A8 int8 (dynamic) checkpoint loads it."""
    for name in quantize_model(model, "int8"):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, DynamicInt8Linear.from_int8(model.get_submodule(name)))


def test_a_w8a8_decode_step_matches_the_torch_path():
    """The whole step with W8A8 projections against the same model's torch path: each projection is bit for
    bit torch's; attention and norms sum in their own orders, so the step is compared to float32 rounding
    (a per-token rounding flip between them moves a value by one int8 step: rare, and small in the norm)."""
    config = tiny_config(attention_bias=True)
    model, _ = random_model(config, blocks=10)
    _w8a8_model(model)
    assert c_step_error_against_torch(model, config) < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_a_w8a8_prompts_rows_do_not_depend_on_chunking_neighbours_or_pieces(kv_dtype, monkeypatch):
    """W8A8 int8 models take the C step (the checkpoint's scheme says "int8": blocker None), whose prompt rows
    are decode rows: the same bits chunked, after a cached prefix, beside decodes and in pieces."""
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    assert blocker(tiny_config(), quantization="int8") is None
    monkeypatch.setattr(invariance, "quantize_model", lambda model, _: _w8a8_model(model))
    config = tiny_config(attention_bias=True)
    invariance._invariant_prompt_rows(config, kv_dtype, "int8")


# ---- static input scales (INT8_S8): compressed-tensors W8A8 int8 with dynamic false ----

def _static_reference(x, q, scales, s: float, z: float = 0.0):
    """The exact arithmetic INT8_S8 computes, in torch: the levels round_to_grid rounds to, integer sums."""
    levels = ((x / torch.tensor(s)).round() + z).clamp(-128, 127) - z
    acc = levels.to(torch.int64) @ q.to(torch.int64).t()
    return acc.to(torch.int32).float() * torch.tensor(s) * scales


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("zero", [0.0, 3.0])
def test_the_static_w8a8_projection_is_the_exact_sum_and_near_torchs(rows, zero):
    """Bit for bit the integer reference; torch's reference arithmetic (StaticInputLinear before Int8Linear
    at reference: the rounded inputs times the dequantized weights in float, `--dtype float32`'s) differs
    by float rounding only."""
    torch.manual_seed(2)
    q, scales = quantize_int8(torch.randn(84, 104))
    b = torch.randn(84)
    x = torch.randn(rows, 104) * 2
    s = 0.03
    out = cpu_decode.linear(cpu_decode.LinearWeights.int8_s8(q, scales, s, zero, b), x)
    assert torch.equal(out, _static_reference(x, q, scales, s, zero) + b)
    inner = Int8Linear(q, scales, b)
    inner.reference = True
    layer = StaticInputLinear(inner, "int8", torch.tensor(s), torch.tensor(zero) if zero else None)
    with torch.inference_mode():
        torch.testing.assert_close(out, layer(x), atol=1e-4, rtol=1e-5)


def test_the_static_grid_rounds_as_torch_rounds():
    """An identity weight passes the rounded inputs through: round_to_grid's bit for bit, ties to even
    (scale 1: x.5 halfway), clamped at the grid's ends, with a zero point."""
    x = torch.tensor([[0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 127.5, -128.5, 300.0, -300.0, 0.25, 3.4999998]])
    identity = torch.eye(12, dtype=torch.int8)
    for zero in (0.0, 5.0):
        weights = cpu_decode.LinearWeights.int8_s8(identity, torch.ones(12), 1.0, zero)
        expected = round_to_grid(x, torch.tensor(1.0), "int8", torch.tensor(zero))
        assert torch.equal(cpu_decode.linear(weights, x), expected)


def test_a_static_w8a8_row_gets_the_same_bits_alone_or_in_a_batch():
    torch.manual_seed(8)
    q, scales = quantize_int8(torch.randn(40, 104))
    weights = cpu_decode.LinearWeights.int8_s8(q, scales, 0.02, 0.0, torch.randn(40))
    assert_rows_alone_equal_batched(weights, torch.randn(13, 104))


def _static_w8a8_model(model) -> None:
    """Every projection as a compressed-tensors W8A8 int8 checkpoint with static input scales loads it."""
    for name in quantize_model(model, "int8"):
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, StaticInputLinear(model.get_submodule(name), "int8",
                                                                      torch.tensor(0.02)))


def test_a_static_w8a8_decode_step_matches_the_torch_path(monkeypatch):
    """Against torch's reference arithmetic (KAON_QUANT_KERNEL=torch: float products of the rounded inputs;
    torch's default CPU int8 kernel re-quantizes the rounded inputs its own way)."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    config = tiny_config(attention_bias=True)
    model, _ = random_model(config, blocks=10)
    _static_w8a8_model(model)
    assert c_step_error_against_torch(model, config) < 1e-4


def test_a_static_w8a8_prompts_rows_do_not_depend_on_chunking_neighbours_or_pieces(monkeypatch):
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    monkeypatch.setattr(invariance, "quantize_model", lambda model, _: _static_w8a8_model(model))
    config = tiny_config(attention_bias=True)
    invariance._invariant_prompt_rows(config, torch.float32, "int8")
