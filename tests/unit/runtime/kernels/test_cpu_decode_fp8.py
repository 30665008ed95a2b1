"""FP8 (e4m3) weights in the fused CPU step (cpu_decode.c, kinds FP8 and FP8_A8; issue 49 §2).

What torch's path computes on CPU for kaon's fp8 (quant/fp8.py: x @ float(q).T * scale + bias, float32
activations, weight-only) and for compressed-tensors FP8 dynamic (quant/dynamic_fp8.py: each input row
rounded to FP8 per token first) is what the kernels must compute: each weight widened exactly, each row
summed in one order whatever the number of rows, so a token's numbers do not move with batch
neighbours, prefill chunks or prefix-cache hits. Each kernel against its pure-torch reference, a whole
step against the torch path, a prompt's rows alone / chunked / cached / beside decodes / in pieces."""
from __future__ import annotations

import pytest
import test_cpu_decode_invariance as invariance
import torch
from test_cpu_decode import assert_rows_alone_equal_batched, c_step_error_against_torch, random_model, tiny_config

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.dynamic_fp8 import DynamicFp8InputLinear, round_to_fp8_per_token
from kaon_runtime.quant.fp8 import FP8, fp8_matmul_ref, quantize_fp8

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)


def _finite_fp8_bytes() -> torch.Tensor:
    """All 254 finite e4m3fn values (0x7f and 0xff are NaN), as float8."""
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    return codes.view(FP8)


def test_every_fp8_value_widens_exactly():
    """Each of the 254 finite values (subnormals, both zeros, +-448) times a one-hot row: the output is the
    value itself times its row's scale, bit for bit (a wrong exponent bias or subnormal path is off by 2^k)."""
    values = _finite_fp8_bytes()
    q = torch.cat([values, values.float().new_zeros(2).to(FP8)]).reshape(32, 8)  # [N=32, K=8]
    scales = torch.full((32,), 0.75)
    out = cpu_decode.linear(cpu_decode.LinearWeights.fp8(q, scales), torch.eye(8))
    assert torch.equal(out, q.float().t() * scales)


@pytest.mark.parametrize("fp8_inputs", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_projection_matches_torch(rows, bias, fp8_inputs):
    torch.manual_seed(0)
    q, scales = quantize_fp8(torch.randn(84, 104))  # 104: the 8-wide loop and a tail; 84: not a tile multiple
    b = torch.randn(84) if bias else None
    x = torch.randn(rows, 104) * torch.logspace(-3, 1, 104)
    out = cpu_decode.linear(cpu_decode.LinearWeights.fp8(q, scales, b, fp8_inputs), x)
    expected = fp8_matmul_ref(round_to_fp8_per_token(x) if fp8_inputs else x, q, scales)
    if bias:
        expected += b
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_fp8_inputs_are_rounded_per_token_as_torch_rounds_them():
    """An identity weight passes the rounded rows through exactly: they equal round_to_fp8_per_token's (the
    compressed-tensors rounding; test_reference_arithmetic.py checks it against compressed-tensors), rows
    spanning e4m3's subnormals, ties, a zero row and a row of one value."""
    torch.manual_seed(1)
    x = torch.randn(6, 64) * torch.logspace(-6, 2, 64)
    x[2] = 0
    x[3] = 3.0
    x[4] = 0  # scale 1 (max 448), values halfway between grid points: ties go to the even neighbour
    x[4, :9] = torch.tensor([448, 1.0625, 1.1875, 3 / 1024, 1 / 1024, -1.0625, 248, 0.013671875, 0.0146484375])
    identity = cpu_decode.LinearWeights.fp8(torch.eye(64).to(FP8), torch.ones(64), fp8_inputs=True)
    assert torch.equal(cpu_decode.linear(identity, x), round_to_fp8_per_token(x))


@pytest.mark.parametrize("fp8_inputs", [False, True])
def test_an_fp8_row_gets_the_same_bits_alone_or_in_a_batch(fp8_inputs):
    torch.manual_seed(7)
    q, scales = quantize_fp8(torch.randn(40, 104))
    weights = cpu_decode.LinearWeights.fp8(q, scales, torch.randn(40), fp8_inputs)
    assert_rows_alone_equal_batched(weights, torch.randn(13, 104))


def _fp8_model(model, fp8_inputs: bool) -> None:
    """kaon's --quantization fp8, or (fp8_inputs) every projection as an FP8-dynamic checkpoint loads it."""
    for name in quantize_model(model, "fp8"):
        if fp8_inputs:
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, DynamicFp8InputLinear(model.get_submodule(name)))


@pytest.mark.parametrize("fp8_inputs", [False, True])
def test_an_fp8_decode_step_matches_the_torch_path(fp8_inputs):
    """The whole step with fp8 projections against the same model's torch path (Fp8Linear's matmul on CPU,
    and for FP8 dynamic its per-token rounding): the same arithmetic, only the summation order differs."""
    config = tiny_config(attention_bias=True)
    model, _ = random_model(config, blocks=10)
    _fp8_model(model, fp8_inputs)
    assert c_step_error_against_torch(model, config) < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("fp8_inputs", [False, True])
def test_an_fp8_prompts_rows_do_not_depend_on_chunking_neighbours_or_pieces(kv_dtype, fp8_inputs, monkeypatch):
    """The engine sends fp8 models to the C step (blocker None), whose prompt rows are decode rows: the same
    bits chunked, after a cached prefix, beside decodes and in pieces; and torch's prefill to float32 rounding."""
    invariance.assert_fp8_prompt_rows_invariant(lambda model: _fp8_model(model, fp8_inputs), kv_dtype, monkeypatch)
