"""int8, fp8 and int4 models whose widths are not whole blocks of 32 take the fused CPU step (issue 49 §2).

The narrow int8 kinds (kaon's int8, group int8) quantize activations in int8 blocks of 32. At a K that is not
whole blocks their copy is packed with zero weight columns up to the next block (cpu_decode.padded_columns) and
kaon_linear copies each input row zero-padded to it (Linear.k_in): a zero lane leaves its block's amax and scale
alone and quantizes to 0, so the result is the true width's, the last block quantized from its true values. The
W8A8 int8, reference int8 and fp8 kinds sum over any K with tails; the vocabulary head's int8 copy (every
quantized model's, fp8's too) is padded as int8 is. Per kind: the projection against torch's reference at odd
shapes, a row alone = batched, the whole step against the module path, a prompt's rows chunked / cached /
beside decodes / in pieces. int4 (Q4_1, groups of 32): kaon's quantizer pads K to whole groups with copies of the
row's last weight (no group's range moves), per-channel checkpoints are padded as they load, and the inputs are
zero-padded (the C step's Linear.k_in, Int4Linear's torch path).
"""
from __future__ import annotations

import pytest
import test_cpu_decode_invariance as invariance
import torch
from test_cpu_decode import assert_rows_alone_equal_batched, c_step_error_against_torch, random_model, tiny_config
from test_cpu_decode_fp8 import _fp8_model
from test_cpu_decode_fp8_block import _block_weights, _convert as _fp8_convert
from test_cpu_decode_moe import many_decodes, moe_layers, one_row
from test_cpu_decode_oddwidth import ODD
from test_cpu_decode_reference import _loaded
from test_cpu_decode_w8a8 import _static_reference, _static_w8a8_model, _w8a8_model

from kaon_runtime.kernels import cpu_decode
from kaon_runtime.kernels.quant_gemm_ref import (
    dequantize_int4,
    dequantize_int8,
    quantize_activations_ref,
    w8a16_matmul_ref,
)
from kaon_runtime.models.cpu_decode_step import blocker
from kaon_runtime.models.fused_weights import linear_weights, reference_weights
from kaon_runtime.quant import quantize_model
from kaon_runtime.quant.dynamic_fp8 import round_to_fp8_per_token
from kaon_runtime.quant.dynamic_inputs import w8a8_reference
from kaon_runtime.quant.fp8 import Fp8Linear, fp8_matmul_ref, quantize_fp8
from kaon_runtime.quant.fp8_block import Fp8BlockLinear
from kaon_runtime.quant.group_int8 import dequantize_group_int8
from kaon_runtime.quant.int4 import Int4Linear, quantize_int4
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8
from kaon_runtime.quant.reference import use_reference_kernels
from kaon_runtime.quant.static_inputs import StaticInputLinear

pytestmark = pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)

# qkv/gate_up, down, fused q|k|v; 44: not a multiple of 8 either; 1: a block of one true value
SHAPES = [(80, 48), (48, 80), (144, 48), (36, 44), (8, 1)]
PASSES = {"int8": 1, "int8x2": 2}


def padded_activations_ref(x: torch.Tensor, passes: int) -> torch.Tensor:
    """x as the narrow kernels see it at any K: blocks of 32, the last one of its true values only (as if
    zero-padded: zeros change no block's amax and quantize to 0)."""
    k = x.shape[1]
    padded = torch.nn.functional.pad(x.float(), (0, -k % cpu_decode.QBLOCK))
    return quantize_activations_ref(padded, passes=passes)[:, :k]


def test_odd_widths_take_the_step_with_int8_fp8_and_int4_weights():
    for method in ("none", "int8", "fp8", "int4"):
        assert blocker(tiny_config(**ODD), quantization=method) is None
        assert blocker(tiny_config(head_dim=20), quantization=method) is None  # o's input alone odd (4 x 20)
    unread = "GPTQ 4-bit, groups of 16"  # a checkpoint the step does not read (its description): refused as before
    assert blocker(tiny_config(**ODD), quantization=unread) is not None
    assert unread in blocker(tiny_config(), quantization=unread)
    # tensor-parallel shards at odd rank widths too, float and quantized (tests/integration/
    # test_tensor_parallel_step.py: rank widths MLP 40, heads 24)
    for method in ("none", "int8", "fp8", "int4"):
        assert blocker(tiny_config(), tp_size=2, quantization=method) is None  # a rank's MLP 48
        assert blocker(tiny_config(**ODD), tp_size=2, quantization=method) is None
        assert blocker(tiny_config(intermediate_size=128), tp_size=4, quantization=method) is None  # heads' width 16


@pytest.mark.parametrize("activations", sorted(PASSES))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_odd_width_int8_matches_its_reference_and_a_row_is_the_same_alone(n, k, activations, monkeypatch):
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    torch.manual_seed(1)
    qweight, scales = quantize_int8(torch.randn(n, k))
    b, x = torch.randn(n), torch.randn(5, k) * torch.logspace(-2, 1, k)
    weights = cpu_decode.LinearWeights.int8(qweight, scales, b)
    assert weights.struct.k % cpu_decode.QBLOCK == 0 and (weights.struct.k_in or weights.struct.k) == k
    expected = torch.nn.functional.linear(padded_activations_ref(x, PASSES[activations]),
                                          dequantize_int8(qweight, scales), b)
    torch.testing.assert_close(cpu_decode.linear(weights, x), expected, atol=1e-4, rtol=1e-4)
    assert_rows_alone_equal_batched(weights, x)
    # the held copy hands torch's paths the true width back (quant/kernel_layout.py)
    plain, plain_scales = cpu_decode.plain_int8(weights)
    assert torch.equal(plain, qweight) and torch.equal(plain_scales, scales)
    ids = torch.tensor([n - 1, 0])
    assert torch.equal(cpu_decode.plain_int8(weights, ids)[0], qweight[ids])


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k", [48, 80])
def test_odd_width_group_int8_default_and_reference_kinds(k, act_order):
    """A GPTQ 8-bit checkpoint's groups of 16 at K = 48 / 80: the module cannot hold the kernel's layout
    (quant/group_int8.py needs whole blocks), so the step reads a copy packed with a zero group (Q8_G16, its
    activations as at any K), and in the reference mode (REF_Q8_G16, act-order's column order too) the
    module's own arithmetic to float32 summation order."""
    module = _loaded(8, 16, act_order=act_order, asymmetric=True, n=40, k=k)
    x = torch.randn(6, k)
    weights = reference_weights(module)
    assert weights is not None and weights.struct.kind == cpu_decode.KIND_REF_Q8_G16
    with torch.inference_mode():
        torch.testing.assert_close(cpu_decode.linear(weights, x), module(x), rtol=1e-5, atol=1e-5)
    assert_rows_alone_equal_batched(weights, x)
    if act_order:
        return
    module.reference = False
    weights = linear_weights(module)
    assert weights.struct.kind == cpu_decode.KIND_Q8_G16
    expected = torch.nn.functional.linear(padded_activations_ref(x, cpu_decode.activation_passes()),
                                          dequantize_group_int8(module.weight), module.bias)
    torch.testing.assert_close(cpu_decode.linear(weights, x), expected, atol=1e-4, rtol=1e-4)
    assert_rows_alone_equal_batched(weights, x)


@pytest.mark.parametrize("activations", sorted(PASSES))
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_odd_width_int4_matches_its_reference_and_a_row_is_the_same_alone(n, k, activations, monkeypatch):
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    torch.manual_seed(4)
    linear = torch.nn.Linear(k, n)
    with torch.no_grad():
        linear.weight.add_(1.0)  # all positive: a zero padding column would move each last group's min to 0
    module = Int4Linear.from_linear(linear)
    assert module.in_features == k and module.padded_features % cpu_decode.QBLOCK == 0
    dense = dequantize_int4(module.packed, module.scales, module.mins, module.group_size)[:, :k]
    if k % cpu_decode.QBLOCK > 1:  # the last group's true weights: as quantized alone (no padding in their range)
        tail = k - k % cpu_decode.QBLOCK
        alone = quantize_int4(linear.weight.detach()[:, tail:], k - tail)
        assert torch.equal(dense[:, tail:], dequantize_int4(alone.packed, alone.scales, alone.mins, k - tail))
    x = torch.randn(5, k) * torch.logspace(-2, 1, k)
    weights = linear_weights(module)
    assert weights.struct.kind == cpu_decode.KIND_Q4_1 and (weights.struct.k_in or weights.struct.k) == k
    expected = torch.nn.functional.linear(padded_activations_ref(x, PASSES[activations]), dense, module.bias)
    torch.testing.assert_close(cpu_decode.linear(weights, x), expected, atol=1e-4, rtol=1e-4)
    assert_rows_alone_equal_batched(weights, x)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")  # the module's own (torch) path reads K inputs too
    with torch.inference_mode():
        torch.testing.assert_close(module(x), torch.nn.functional.linear(x, dense, module.bias), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("k", [48, 20])
def test_a_per_channel_int4_checkpoint_at_an_odd_width_is_padded_as_it_loads(k, act_order):
    """compressed-tensors / GPTQ int4 per channel (one group per row, cpu_fused) at K = 48 / 20: held in groups
    of 32 with a zero-input padding, read by Q4_1 (default) and REF_Q4 (reference mode, act-order's order too)."""
    module = _loaded(4, k, act_order=act_order, asymmetric=True, n=40, k=k)
    x = torch.randn(6, k)
    weights = reference_weights(module)
    assert weights is not None and weights.struct.kind == cpu_decode.KIND_REF_Q4
    with torch.inference_mode():
        expected = module(x)
    torch.testing.assert_close(cpu_decode.linear(weights, x), expected, rtol=1e-5, atol=1e-5)
    assert_rows_alone_equal_batched(weights, x)
    if act_order:
        return
    module.reference = False
    weights = linear_weights(module)
    assert weights.struct.kind == cpu_decode.KIND_Q4_F32 and weights.struct.k_in == k  # (float32 scales)
    dense = dequantize_int4(module.packed, module.scales, module.mins, module.group_size)[:, :k]
    reference = torch.nn.functional.linear(padded_activations_ref(x, cpu_decode.activation_passes()), dense,
                                           module.bias)
    torch.testing.assert_close(cpu_decode.linear(weights, x), reference, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.nn.functional.linear(x, dense, module.bias), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_odd_width_w8a8_and_reference_int8_match_torch_and_a_row_is_the_same_alone(n, k):
    torch.manual_seed(2)
    q, scales = quantize_int8(torch.randn(n, k))
    b, x = torch.randn(n), torch.randn(5, k) * 2
    dynamic = cpu_decode.LinearWeights.int8_a8(q, scales, b)
    assert torch.equal(cpu_decode.linear(dynamic, x), w8a8_reference(x, q, scales) + b)
    static = cpu_decode.LinearWeights.int8_s8(q, scales, 0.03, 3.0, b)
    assert torch.equal(cpu_decode.linear(static, x), _static_reference(x, q, scales, 0.03, 3.0) + b)
    reference = cpu_decode.LinearWeights.ref_int8(q, scales, b)
    torch.testing.assert_close(cpu_decode.linear(reference, x), w8a16_matmul_ref(x, q, scales) + b,
                               rtol=1e-5, atol=1e-5)
    for weights in (dynamic, static, reference):
        assert_rows_alone_equal_batched(weights, x)


@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_odd_width_fp8_kinds_match_torch_and_a_row_is_the_same_alone(n, k):
    torch.manual_seed(3)
    q, scales = quantize_fp8(torch.randn(n, k))
    b, x = torch.randn(n), torch.randn(5, k) * torch.logspace(-3, 1, k)
    for fp8_inputs in (False, True):
        weights = cpu_decode.LinearWeights.fp8(q, scales, b, fp8_inputs)
        expected = fp8_matmul_ref(round_to_fp8_per_token(x) if fp8_inputs else x, q, scales) + b
        torch.testing.assert_close(cpu_decode.linear(weights, x), expected, atol=1e-4, rtol=1e-5)
        assert_rows_alone_equal_batched(weights, x)
    static = StaticInputLinear(Fp8Linear(q, scales, b), "fp8", torch.tensor(0.01))
    block = (16, 32)  # the last block of columns partial at every odd K
    bq, bscales = _block_weights(n, k, block, seed=4)
    blocks = Fp8BlockLinear(bq, bscales, block, b)
    for module in (static, blocks, StaticInputLinear(blocks, "fp8", torch.tensor(0.01))):
        weights = module.fused_cpu_weights()
        with torch.inference_mode():
            torch.testing.assert_close(cpu_decode.linear(weights, x), module(x), atol=1e-4, rtol=1e-5)
        assert_rows_alone_equal_batched(weights, x)




def _reference_int8_model(model) -> None:
    """--dtype float32 on a W8A16 checkpoint: int8 per channel in its reference arithmetic (REF_INT8)."""
    quantize_model(model, "int8")
    use_reference_kernels(model)


CONVERTERS = {"w8a8": _w8a8_model, "w8a8-static": _static_w8a8_model, "int8-reference": _reference_int8_model,
              "fp8": lambda model: _fp8_model(model, False), "fp8-inputs": lambda model: _fp8_model(model, True),
              "fp8-block": lambda model: _fp8_convert(model, "block"),
              "fp8-block-static": lambda model: _fp8_convert(model, "block-static")}


@pytest.mark.parametrize("kind", sorted(CONVERTERS))
def test_an_odd_width_step_matches_the_torch_path(kind, monkeypatch):
    """The whole step at hidden 48 / MLP 80 / head_dim 12 against the same model's torch path (the same arithmetic
    per projection; attention and norms in other summation orders; static W8A8 against torch's reference arithmetic,
    as test_cpu_decode_w8a8 does: torch's default CPU int8 kernel re-quantizes the rounded inputs its own way)."""
    if kind == "w8a8-static":
        monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    config = tiny_config(attention_bias=True, **ODD)
    model, _ = random_model(config, blocks=10)
    CONVERTERS[kind](model)
    assert c_step_error_against_torch(model, config) < 1e-4
    assert model.model.cpu_decode is not None, "the C step runs it"


@pytest.mark.parametrize("activations", sorted(PASSES))
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_an_odd_width_narrow_step_matches_its_reference(method, activations, monkeypatch):
    """kaon's int8 / int4 at hidden 48 / MLP 80 / head_dim 12: the dequantizing torch path fed what the narrow
    kernels see (int8 blocks, the last of its true values only) at every quantized projection (as
    test_cpu_decode.test_a_quantized_decode_step_matches_its_reference at whole blocks)."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", activations)
    passes = PASSES[activations]
    config = tiny_config(attention_bias=True, **ODD)
    model, _ = random_model(config, blocks=10)
    quantized = [model.get_submodule(name) for name in quantize_model(model, method)]
    error = c_step_error_against_torch(model, config, quantized, lambda x: padded_activations_ref(x, passes))
    assert error < {"int8": 1e-4, "int8x2": 1e-3}[activations]


@pytest.mark.parametrize("kind", ["int8", "int4", "w8a8", "int8-reference", "fp8", "fp8-inputs", "fp8-block"])
def test_an_odd_width_prompts_rows_are_invariant(kind, monkeypatch):
    """The same bits chunked, after a cached prefix, beside decodes and in pieces."""
    monkeypatch.delenv("KAON_CPU_PREFILL", raising=False)
    monkeypatch.delenv("KAON_CPU_ACTIVATIONS", raising=False)
    if kind in CONVERTERS:
        monkeypatch.setattr(invariance, "quantize_model", lambda model, _: CONVERTERS[kind](model))
    invariance._invariant_prompt_rows(tiny_config(attention_bias=True, **ODD), torch.float32, kind)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_an_odd_width_narrow_half_model_step_equals_the_float32_step(method):
    invariance.assert_half_step_equals_float32_step(tiny_config(attention_bias=True, **ODD), torch.bfloat16, method)


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_the_odd_width_vocabulary_head_takes_its_padded_int8_copy(method):
    """Every quantized model's head is an int8 copy (quant/surgery.py), fp8's too: at hidden 48 it is packed with
    zero columns; its logits near torch's (bfloat16 activations there, int8 blocks here), rows alone as batched."""
    config = tiny_config(**ODD)
    model, _ = random_model(config, blocks=2)
    quantize_model(model, method)
    model.check_kernels()
    head = model.lm_head
    assert isinstance(head.quantized, Int8Linear) and head.cpu_weights().struct.k_in == config.hidden_size
    hidden = torch.randn(3, config.hidden_size)
    with torch.inference_mode():
        fast = model.compute_logits(hidden)
        assert torch.equal(model.compute_logits(hidden[1:2])[0], fast[1])
        rows, head.cpu_logits_rows = head.cpu_logits_rows, 0
        expected = model.compute_logits(hidden)
    assert rows >= hidden.shape[0]
    torch.testing.assert_close(fast, expected, atol=0.05, rtol=0.05)


# ---- mixture-of-experts layers whose experts' width is not whole blocks (experts_mlp: kaon_linear per expert) ----

ODD_MOE = dict(ODD, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40, norm_topk_prob=True)


def _odd_experts(model, method: str) -> list[torch.nn.Module]:
    """Each MoE layer's experts as per-expert quantized linears (a quantized checkpoint's), int4 padded to whole
    groups as kaon's quantizer pads them."""
    linears = []
    for moe in moe_layers(model):
        if method == "int8":
            make = lambda w: Int8Linear(*quantize_int8(w))  # noqa: E731
        else:
            make = lambda w: Int4Linear(quantize_int4(w, 32, pad=True))  # noqa: E731
        gate_up = [make(moe.w13[e].detach()) for e in range(moe.w13.shape[0])]
        down = [make(moe.w2[e].detach()) for e in range(moe.w2.shape[0])]
        moe.keep_experts_quantized(gate_up, down)
        linears += gate_up + down
    return linears


def test_odd_expert_widths_take_the_step():
    for method in ("none", "int8", "fp8", "int4"):
        assert blocker(tiny_config(**ODD_MOE), quantization=method) is None


@pytest.mark.parametrize("experts", ["float32", "int8", "int4"])
def test_an_odd_width_moe_step_matches_its_reference(experts, monkeypatch):
    """Hidden 48, experts 40 wide: float experts against the torch path; per-expert int8 / int4 linears against
    torch's QuantizedExperts fed what the narrow kernels see (int8 blocks, the last of its true values only)."""
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    config = tiny_config(**ODD_MOE)
    model, _ = random_model(config, blocks=10)
    linears = [] if experts == "float32" else _odd_experts(model, experts)
    passes = cpu_decode.activation_passes()
    error = c_step_error_against_torch(model, config, linears, lambda x: padded_activations_ref(x, passes))
    assert error < (1e-5 if experts == "float32" else 1e-4)


@pytest.mark.parametrize("experts", ["float32", "int8", "int4"])
def test_an_odd_width_moe_row_gets_the_same_bits_alone_or_beside_rows_sharing_its_experts(experts):
    config = tiny_config(**ODD_MOE)
    model, _ = random_model(config, blocks=12)
    if experts != "float32":
        _odd_experts(model, experts)
    model.check_kernels()
    x, positions, meta = many_decodes(config, 12)
    with torch.inference_mode():
        batched = model.model(x.clone(), positions, meta)
        for i in range(x.shape[0]):
            alone = model.model(x[i:i + 1].clone(), positions[i:i + 1], one_row(meta, i))
            assert torch.equal(alone[0], batched[i]), f"row {i}"
