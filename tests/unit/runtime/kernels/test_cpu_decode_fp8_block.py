"""Block-scaled FP8 weights and FP8 static input scales in the fused CPU step (cpu_decode.c, kinds FP8_BLOCK
and FP8_STATIC, and both together: FP8_BLOCK with an input_scale; issue 49 §2).

What torch's path computes on CPU is what the kernels must compute: for block FP8 (quant/fp8_block.py)
x @ (float(q) * its block's scale).T + bias in float32, for static inputs (quant/static_inputs.py) each
input rounded to fp8(x / scale) * scale first, then the per-channel FP8 product, or the block product.
Each kernel against its pure-torch reference, the widening and the rounding bit for bit, a row alone against
it batched, a whole step against the torch path, a prompt's rows alone / chunked / cached / beside decodes /
in pieces."""
from __future__ import annotations

import pytest
import test_cpu_decode_invariance as invariance
import torch
from test_cpu_decode import assert_rows_alone_equal_batched, c_step_error_against_torch, random_model, tiny_config

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.fp8 import FP8, Fp8Linear, quantize_fp8
from kaon_runtime.quant.fp8_block import Fp8BlockLinear, dequantize_fp8_blocks
from kaon_runtime.quant.static_inputs import StaticInputLinear, round_to_grid

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
BLOCK = (16, 32)  # the tiny models' blocks: several per weight, a short last one where 96 or 200 columns end


def quantize_fp8_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """float [N, K] -> (float8 [N, K], float32 scales [ceil(N / b0), ceil(K / b1)]): each block's largest |w|
    maps to 448, as DeepSeek's and compressed-tensors' block quantization does."""
    n, k = weight.shape
    b0, b1 = block
    rows, cols = -(-n // b0), -(-k // b1)
    padded = torch.zeros(rows * b0, cols * b1)
    padded[:n, :k] = weight.float()
    amax = padded.reshape(rows, b0, cols, b1).abs().amax((1, 3)).clamp(min=torch.finfo(torch.float32).tiny)
    scales = amax / 448
    full = scales.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:n, :k]
    return (weight.float() / full).clamp(-448, 448).to(FP8), scales


def _block_weights(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    weight = torch.randn(n, k) * torch.logspace(-2, 1, k)  # blocks of very different scales
    return quantize_fp8_blocks(weight, block)


@pytest.mark.parametrize("block", [(16, 32), (128, 128), (1, 200)])
def test_each_block_fp8_weight_is_widened_times_its_scale_exactly(block):
    """An identity input: each output is one weight, float(q) * its block's scale, bit for bit what
    dequantize_fp8_blocks computes (a wrong block index or a second rounding shows)."""
    q, scales = _block_weights(84, 200, block, seed=0)
    out = cpu_decode.linear(cpu_decode.LinearWeights.fp8_block(q, scales, block), torch.eye(200))
    assert torch.equal(out, dequantize_fp8_blocks(q, scales, block).t())


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_block_fp8_projection_matches_torch(rows, bias, block):
    q, scales = _block_weights(84, 200, block, seed=1)  # 84 rows: not a tile multiple; 200: the 8-wide loop's tail
    b = torch.randn(84) if bias else None
    x = torch.randn(rows, 200)
    out = cpu_decode.linear(cpu_decode.LinearWeights.fp8_block(q, scales, block, b), x)
    expected = Fp8BlockLinear(q, scales, block, b)(x)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)


def test_static_fp8_inputs_are_rounded_as_torch_rounds_them():
    """An identity weight passes the rounded rows through: they equal round_to_grid's bit for bit (its x / scale,
    clamped to +-448, rounded to e4m3, times scale), rows beyond the grid's range, subnormals, ties, zeros."""
    torch.manual_seed(2)
    scale = 0.0123
    x = torch.randn(6, 64) * torch.logspace(-6, 1, 64)
    x[2] = 0
    x[3, :4] = torch.tensor([1e4, -1e4, 448 * scale, 449 * scale])  # clamped to +-448
    x[4, :6] = torch.tensor([1.0625, 1.1875, 3 / 1024, 1 / 1024, -1.0625, 248]) * scale  # ties: to the even one
    identity = cpu_decode.LinearWeights.fp8(torch.eye(64).to(FP8), torch.ones(64), input_scale=scale)
    scale_t = torch.tensor(scale)  # StaticInputLinear's buffer: float32
    assert torch.equal(cpu_decode.linear(identity, x), round_to_grid(x, scale_t, "fp8"))


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_static_fp8_projection_matches_torch(rows, bias):
    torch.manual_seed(3)
    q, scales = quantize_fp8(torch.randn(84, 104))
    b = torch.randn(84) if bias else None
    x = torch.randn(rows, 104)
    module = StaticInputLinear(Fp8Linear(q, scales, b), "fp8", torch.tensor(0.01))
    out = cpu_decode.linear(module.fused_cpu_weights(), x)
    torch.testing.assert_close(out, module(x), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("block", [(16, 32), (128, 128)])
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_block_fp8_with_static_inputs_matches_torch(rows, bias, block):
    """compressed-tensors block FP8 with a static input scale: StaticInputLinear over Fp8BlockLinear, as the
    loader builds it; each input rounded at the fixed scale, then the block product."""
    q, scales = _block_weights(84, 200, block, seed=4)
    b = torch.randn(84) if bias else None
    x = torch.randn(rows, 200)
    module = StaticInputLinear(Fp8BlockLinear(q, scales, block, b), "fp8", torch.tensor(0.01))
    weights = module.fused_cpu_weights()
    assert weights.struct.kind == cpu_decode.KIND_FP8_BLOCK and weights.struct.input_scale > 0
    out = cpu_decode.linear(weights, x)
    torch.testing.assert_close(out, module(x), atol=1e-4, rtol=1e-5)
    unrounded = Fp8BlockLinear(q, scales, block, b)(x)  # the rounding matters at this scale
    assert (out - unrounded).abs().max() > 1e-2


def test_static_inputs_over_block_fp8_are_rounded_as_torch_rounds_them():
    """Identity blocks (every scale 1): the output is the rounded input, round_to_grid's bits, as for FP8_STATIC."""
    torch.manual_seed(5)
    scale = 0.0123
    x = torch.randn(5, 64) * torch.logspace(-6, 1, 64)
    x[3, :4] = torch.tensor([1e4, -1e4, 448 * scale, 449 * scale])  # clamped to +-448
    x[4, :4] = torch.tensor([1.0625, 1.1875, 3 / 1024, -1.0625]) * scale  # ties: to the even one
    identity = cpu_decode.LinearWeights.fp8_block(torch.eye(64).to(FP8), torch.ones(4, 2), (16, 32), input_scale=scale)
    assert torch.equal(cpu_decode.linear(identity, x), round_to_grid(x, torch.tensor(scale), "fp8"))


@pytest.mark.parametrize("kind", ["block", "static", "block-static"])
def test_a_row_gets_the_same_bits_alone_or_in_a_batch(kind):
    if kind.startswith("block"):
        q, scales = _block_weights(40, 104, BLOCK, seed=7)
        weights = cpu_decode.LinearWeights.fp8_block(q, scales, BLOCK, torch.randn(40),
                                                     input_scale=0.02 if kind == "block-static" else None)
    else:
        torch.manual_seed(7)
        q, scales = quantize_fp8(torch.randn(40, 104))
        weights = cpu_decode.LinearWeights.fp8(q, scales, torch.randn(40), input_scale=0.02)
    assert_rows_alone_equal_batched(weights, torch.randn(13, 104))


def _convert(model, kind: str) -> None:
    """Every projection as a block-FP8 checkpoint loads it (Fp8BlockLinear), as an FP8 checkpoint with static
    input scales does (StaticInputLinear over Fp8Linear; the scale from the layer's input range, coarse enough
    that the rounding matters), or as a block-FP8 one with static input scales (StaticInputLinear over
    Fp8BlockLinear)."""
    floats = {name: module.weight.detach().clone() for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear)}
    for name in quantize_model(model, "fp8"):
        parent, _, child = name.rpartition(".")
        module = model.get_submodule(name)
        if kind == "block":
            q, scales = quantize_fp8_blocks(floats[name], BLOCK)
            setattr(model.get_submodule(parent), child, Fp8BlockLinear(q, scales, BLOCK, module.bias))
        elif kind == "block-static":
            q, scales = quantize_fp8_blocks(floats[name], BLOCK)
            setattr(model.get_submodule(parent), child,
                    StaticInputLinear(Fp8BlockLinear(q, scales, BLOCK, module.bias), "fp8", torch.tensor(0.05)))
        else:
            setattr(model.get_submodule(parent), child, StaticInputLinear(module, "fp8", torch.tensor(0.05)))


@pytest.mark.parametrize("kind", ["block", "static", "block-static"])
def test_a_decode_step_matches_the_torch_path(kind):
    """The whole step with these projections against the same model's torch path: the same arithmetic, only
    the summation order differs."""
    config = tiny_config(attention_bias=True)
    model, _ = random_model(config, blocks=10)
    _convert(model, kind)
    assert c_step_error_against_torch(model, config) < 1e-4


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kind", ["block", "static", "block-static"])
def test_a_prompts_rows_do_not_depend_on_chunking_neighbours_or_pieces(kv_dtype, kind, monkeypatch):
    """A prompt's rows are the same bits chunked, after a cached prefix, beside decodes and in pieces; and
    torch's prefill to float32 rounding."""
    invariance.assert_fp8_prompt_rows_invariant(lambda model: _convert(model, kind), kv_dtype, monkeypatch)
