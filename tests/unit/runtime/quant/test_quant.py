"""Weight quantization: Triton GEMMs against their torch references (interpreted on CPU),
quantize/dequantize error bounds, GGUF Q4_1 blocks taken bit for bit, module surgery."""
from __future__ import annotations

import copy
import typing

import numpy as np
import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.config import EngineConfig
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.kernels import cpu_decode, quant_gemm, quant_gemm_cpu
from kaon_runtime.kernels.quant_gemm_ref import (
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    unpack_int4,
    w4a16_matmul_ref,
    w8a16_matmul_ref,
)
from kaon_runtime.quant import METHODS as QUANT_METHODS, quantize_model
from kaon_runtime.quant.fp8 import Fp8Linear, fp8_matmul_ref, quantize_fp8
from kaon_runtime.quant.gguf import int4_from_q4_1
from kaon_runtime.quant.int4 import Int4Linear, quantize_int4
from kaon_runtime.quant.int8 import Int8Linear, quantize_int8
from support import MODEL
from support.tiny_llama import PROMPTS as TINY_PROMPTS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter multiplies bfloat16 matrices wrongly (tl.dot on bf16 operands), so bf16 is checked on GPUs only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])
# Kernel and reference both accumulate in float32; they differ in summation order, then in the final rounding.
CLOSE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
         torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
ROWS = [1, 5, 33]  # decode, a small prefill, more than one 16-row tile


def _x(m, k, dtype):
    # A column slice of a wider tensor: rows are strided, as the launchers must accept.
    return torch.randn(m, k + 8, device=DEVICE)[:, :k].to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("split_k", [None, 2, 4], ids=["split-auto", "split-2", "split-4"])
def test_w8a16_kernel_matches_reference(dtype, m, split_k):
    torch.manual_seed(0)
    n, k = 80, 200  # not multiples of the 64-wide tiles: masked edges on both axes; 4 K steps for 4 ranges
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEVICE)
    scales = torch.rand(n, device=DEVICE) / 100
    x = _x(m, k, dtype)
    out = quant_gemm.w8a16_matmul(x, qweight, scales, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, w8a16_matmul_ref(x, qweight, scales), **CLOSE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m", ROWS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("split_k", [None, 5], ids=["split-auto", "split-5"])
def test_w4a16_kernel_matches_reference(dtype, m, group_size, split_k):
    torch.manual_seed(0)
    n, k = 72, 384  # 3 to 12 groups: 5 ranges of 2 or 3 groups leave the last ranges short or empty
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=DEVICE)
    scales = (torch.rand(n, k // group_size, device=DEVICE) / 50).half()
    mins = (-torch.rand(n, k // group_size, device=DEVICE) / 7).half()
    x = _x(m, k, dtype)
    out = quant_gemm.w4a16_matmul(x, packed, scales, mins, group_size, split_k=split_k)
    assert out.dtype == dtype and out.shape == (m, n)
    torch.testing.assert_close(out, w4a16_matmul_ref(x, packed, scales, mins, group_size), **CLOSE[dtype])


def test_w4a16_kernel_rejects_unsupported_shapes():
    packed = torch.zeros(16, 48, dtype=torch.uint8, device=DEVICE)
    groups = torch.zeros(16, 3, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError, match="not a multiple of the group size 64"):
        quant_gemm.w4a16_matmul(_x(1, 96, torch.float32), packed, groups[:, :1], groups[:, :1], 64)
    with pytest.raises(AssertionError, match="power of two >= 32"):
        quant_gemm.w4a16_matmul(_x(1, 96, torch.float32), packed, groups.repeat(1, 2), groups.repeat(1, 2), 16)


def test_kernels_take_an_empty_batch():
    x = torch.empty(0, 64, device=DEVICE)
    assert quant_gemm.w8a16_matmul(x, *quantize_int8(torch.randn(32, 64, device=DEVICE))).shape == (0, 32)
    w = quantize_int4(torch.randn(32, 64, device=DEVICE))
    assert quant_gemm.w4a16_matmul(x, w.packed, w.scales, w.mins, w.group_size).shape == (0, 32)


# ---- quantize / dequantize ---------------------------------------------------------------

def _weight(n=48, k=192):
    torch.manual_seed(1)
    w = torch.randn(n, k) * 0.05
    w[3] *= 40  # one row with outliers, one row of zeros: scales must cope with both
    w[7] = 0
    return w


def test_int8_round_trip_error_is_within_half_a_step():
    w = _weight()
    qweight, scales = quantize_int8(w)
    assert qweight.dtype == torch.int8 and qweight.abs().max() <= 127
    err = (dequantize_int8(qweight, scales) - w).abs()
    assert (err <= scales[:, None] / 2 * (1 + 1e-5)).all()
    assert err[7].max() == 0


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_error_is_within_half_a_step(group_size):
    w = _weight()
    q = quantize_int4(w, group_size)
    assert q.packed.shape == (48, 96) and q.scales.shape == q.mins.shape == (48, 192 // group_size)
    err = (dequantize_int4(q.packed, q.scales, q.mins, group_size) - w).abs().reshape(48, -1, group_size)
    # Half a step, plus what storing the scale and min as float16 can shift the grid by.
    step, low = q.scales.float()[..., None], q.mins.float()[..., None]
    bound = step / 2 + (low.abs() + 15 * step) * 2 ** -11 + 1e-7
    assert (err <= bound).all()
    assert err[7].max() == 0


def test_int4_rejects_a_ragged_group():
    with pytest.raises(ValueError, match="not a multiple of the group size 32"):
        quantize_int4(torch.randn(4, 48))


def test_int4_pack_unpack_round_trip():
    q = torch.randint(0, 16, (6, 128), dtype=torch.uint8)
    packed = pack_int4(q, 64)
    assert packed.shape == (6, 64)
    assert torch.equal(unpack_int4(packed, 64), q)
    # Byte j of a group: element j low, element j + group / 2 high.
    assert packed[0, 0] == q[0, 0] | (q[0, 32] << 4)


def test_fp8_round_trip_error_is_within_e4m3_precision():
    w = _weight()
    qweight, scales = quantize_fp8(w)
    assert qweight.dtype == torch.float8_e4m3fn
    err = (qweight.float() * scales[:, None] - w).abs()
    # 3 mantissa bits: half an ulp is 2^-4 of the value; below 2^-6 (subnormals) the step is 2^-9.
    assert (err <= w.abs() * 2 ** -4 + scales[:, None] * 2 ** -10 + 1e-12).all()


def test_q4_1_blocks_load_bit_for_bit():
    gguf = pytest.importorskip("gguf")
    w = _weight(8, 96).numpy()
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_1)  # uint8 [rows, 3 blocks * 20 bytes]
    expected = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1))
    q = int4_from_q4_1(torch.from_numpy(np.array(raw)).view(8, -1, 20))
    assert q.group_size == 32
    assert torch.equal(dequantize_int4(q.packed, q.scales, q.mins, 32), expected)
    # Our quantizer is Q4_1's min/max rule: from the dequantized weights it finds the same blocks again.
    again = quantize_int4(expected, 32)
    assert torch.equal(again.packed, q.packed) and torch.equal(again.scales, q.scales)
    assert torch.equal(again.mins, q.mins)


# ---- the runtime linears -------------------------------------------------------------

def _linear(k=64, n=40, bias=True):
    torch.manual_seed(2)
    linear = torch.nn.Linear(k, n, bias=bias, device=DEVICE)
    with torch.no_grad():
        linear.weight.mul_(3)
    return linear


@pytest.mark.parametrize("make", [Int8Linear.from_linear, Int4Linear.from_linear], ids=["int8", "int4"])
def test_quantized_linear_kernels_agree_and_track_the_float_layer(make, monkeypatch):
    linear = _linear()
    layer = make(linear)
    x = torch.randn(2, 3, 64, device=DEVICE)  # leading dims are flattened and restored
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    reference = layer(x)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "triton")
    torch.testing.assert_close(layer(x), reference, **CLOSE[torch.float32])
    assert reference.shape == (2, 3, 40)
    relative = (reference - linear(x)).norm() / linear(x).norm()
    assert relative < (0.01 if isinstance(layer, Int8Linear) else 0.1)


@pytest.mark.parametrize("rows", [5, quant_gemm_cpu.DENSE_ROWS], ids=["decode-rows", "prefill-rows"])
@pytest.mark.parametrize("make, n", [(Int8Linear.from_linear, 40), (Int4Linear.from_linear, 48),
                                     (Int4Linear.from_linear, 40)], ids=["int8", "int4", "int4-rows-not-16"])
def test_cpu_kernels_track_the_reference(make, n, rows, monkeypatch):
    # Few rows take torch's packed-weight CPU kernels, many the widened weight's dense GEMM; both
    # take bfloat16 activations (where the CPU has them): the difference from the dequantizing
    # reference is bfloat16 rounding, far below what a layout, scale or grid slip would give.
    # int4 with out_features not a multiple of 16 falls back to the reference for few rows.
    linear = _linear(n=n).cpu()
    layer = make(linear)
    x = torch.randn(rows, 64)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    reference = layer(x)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "cpu")
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == reference.shape
    assert (out - reference).norm() / reference.norm() < 0.01
    if isinstance(layer, Int4Linear):
        assert (layer._cpu_weight is None) == (n % 16 != 0 or rows >= quant_gemm_cpu.DENSE_ROWS)


@pytest.mark.parametrize("make", [Int8Linear.from_linear, Int4Linear.from_linear], ids=["int8", "int4"])
def test_the_dense_path_in_float32_is_the_reference(make, monkeypatch):
    # Where the CPU lacks bfloat16 dot products the widened weight stays float32: then the dense
    # path computes what the reference does, up to the order of the sums.
    layer = make(_linear().cpu())
    x = torch.randn(quant_gemm_cpu.DENSE_ROWS, 64)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    reference = layer(x)
    monkeypatch.setenv("KAON_QUANT_KERNEL", "cpu")
    monkeypatch.setattr(quant_gemm_cpu, "dense_dtype", lambda: torch.float32)
    torch.testing.assert_close(layer(x), reference, rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n, k, group_size", [(40, 576, 32), (24, 128, 64), (8, 60, 20), (3, 12, 6)],
                         ids=["q4_1", "group-64", "group-20-tail", "group-6-scalar"])
@pytest.mark.parametrize("threads", [1, 3])
def test_the_c_widening_of_int4_weights_is_torchs_bit_for_bit(dtype, n, k, group_size, threads):
    # Prefill's dense GEMM widens each int4 weight on every call (quant_gemm_cpu.widen_int4); the C pass must give
    # the bits torch's dequantize-then-convert gives (product and sum each rounded to float32, no fused
    # multiply-add; bfloat16 rounded to nearest even), or prefill would no longer compute what it did.
    lib = cpu_decode.library()
    assert lib is not None
    weight = quantize_int4(torch.randn(n, k) * 0.05, group_size)
    expected = dequantize_int4(weight.packed, weight.scales, weight.mins, group_size).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        widened = cpu_decode.widen_q4_1(lib, weight.packed, weight.scales, weight.mins, group_size, dtype)
    finally:
        torch.set_num_threads(before)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert widened.dtype == dtype and torch.equal(widened.view(bits), expected.view(bits))
    assert torch.equal(quant_gemm_cpu.widen_int4(weight.packed, weight.scales, weight.mins, group_size, dtype)
                       .view(bits), expected.view(bits))


def test_unknown_kernel_choice_is_refused(monkeypatch):
    monkeypatch.setenv("KAON_QUANT_KERNEL", "cuda")
    with pytest.raises(ValueError, match="KAON_QUANT_KERNEL"):
        Int8Linear.from_linear(_linear())(torch.randn(1, 64, device=DEVICE))


def test_fp8_reference_tracks_the_float_layer():
    linear = _linear(bias=False)
    qweight, scales = quantize_fp8(linear.weight.detach())
    x = torch.randn(4, 64, device=DEVICE)
    out = fp8_matmul_ref(x, qweight, scales)
    assert (out - linear(x)).norm() / linear(x).norm() < 0.05


# ---- module surgery ------------------------------------------------------------------

def _tiny_llama():
    from kaon_runtime.config import ModelConfig
    from kaon_runtime.models.decoder import DecoderForCausalLM

    config = ModelConfig(architecture="llama", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=64)
    torch.manual_seed(3)
    model = DecoderForCausalLM(config)
    with torch.no_grad():  # both are allocated uninitialised; garbage may hold NaN, which equals nothing
        model.lm_head.weight_t.normal_()
        model.model.embed_tokens.weight.normal_()
    return model


# Relative error of two stacked projections with uniform random weights: 4 bits leave ~7% per matmul.
@pytest.mark.parametrize("method,kind,tolerance", [("int8", Int8Linear, 0.02), ("int4", Int4Linear, 0.25),
                                                   ("fp8", Fp8Linear, 0.1)])
def test_surgery_swaps_every_projection_and_nothing_else(method, kind, tolerance):
    model = _tiny_llama()
    float_mlp = copy.deepcopy(model.model.layers[1].mlp)
    head, embed = model.lm_head.weight_t.clone(), model.model.embed_tokens.weight.clone()
    hidden = torch.randn(3, 64)
    float_logits = hidden @ head
    swapped = quantize_model(model, method)
    assert sorted(swapped) == sorted(f"model.layers.{i}.{p}" for i in range(2) for p in
                                     ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"))
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    assert all(isinstance(model.get_submodule(name), kind) for name in swapped)
    # The embedding stays in full precision; the head's logits come from an int8 copy whatever the method,
    # and this untied model's float head is released.
    assert torch.equal(model.model.embed_tokens.weight, embed)
    assert isinstance(model.lm_head.quantized, Int8Linear) and model.lm_head.weight_t is None
    with torch.no_grad():
        logits = model.compute_logits(hidden)
    assert (logits - float_logits).norm() / float_logits.norm() < 0.02
    x = torch.randn(3, 64)
    with torch.no_grad():
        expected, got = float_mlp(x), model.model.layers[1].mlp(x)
    assert (got - expected).norm() / expected.norm() < tolerance


def test_surgery_takes_prequantized_int4_weights_as_given():
    model = _tiny_llama()
    name = "model.layers.0.mlp.down_proj"
    given = quantize_int4(torch.randn(64, 96), 32)
    quantize_model(model, "int4", prequantized={name: given})
    assert model.get_submodule(name).packed is given.packed
    with pytest.raises(ValueError, match="does not fit"):
        quantize_model(_tiny_llama(), "int4", prequantized={name: quantize_int4(torch.randn(64, 64), 32)})


def test_fuse_rows_stacks_shards_like_load_weights():
    model = _tiny_llama()
    parts = {p: torch.full((rows, 2), i) for i, (p, rows) in enumerate([("q", 64), ("k", 32), ("v", 32)])}
    fused = model.fuse_rows([(f"model.layers.0.self_attn.{p}_proj.weight", t) for p, t in parts.items()] +
                            [("model.layers.1.mlp.gate_proj.weight", torch.zeros(96, 2))])  # up is missing
    assert list(fused) == ["model.layers.0.self_attn.qkv_proj.weight"]
    assert torch.equal(fused["model.layers.0.self_attn.qkv_proj.weight"], torch.cat(list(parts.values())))


def test_every_quantization_an_inferenceservice_may_ask_for_is_built():
    from kaon_operator.api import ModelSpec
    from kaon_runtime.cli import build_parser

    for method in typing.get_args(ModelSpec.model_fields["quantization"].annotation):
        args = build_parser().parse_args(["serve", "--quantization", method])
        assert EngineConfig(quantization=args.quantization).quantization == method
        assert method == "none" or method in QUANT_METHODS


def test_unknown_methods_are_refused():
    with pytest.raises(ValueError, match="unknown quantization 'int3'"):
        quantize_model(_tiny_llama(), "int3")
    with pytest.raises(InvalidRequestError, match="quantization must be one of none, int8, int4, fp8"):
        EngineConfig(quantization="int3")


# ---- the real bundled model through the engine ---------------------------------------

QUESTIONS = ["What is the capital of France?", "Write a haiku about Kubernetes.",
             "Explain in one sentence what a KV cache is.", "List three prime numbers greater than 100.",
             "Translate 'good morning, how are you?' into Spanish.", "What is 17 * 23?",
             "Who wrote 'Pride and Prejudice'?", "Give me a short motivational quote."]
# Measured on 22 chat prompts x 24 greedy tokens: int8 left the float model's path only where
# the float model's top two tokens were within 0.42 nats of each other (8 times, always for
# its runner-up or a third near-tied token). A divergence at a margin of 1 nat would mean
# a real error, not rounding.
NEAR_TIE_NATS = 1.0


def _greedy(llm, max_tokens=10):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2)
    return [o.outputs[0] for o in llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params,
                                           use_tqdm=False)]


def _quantized_llm(method):
    return LLM(MODEL, show_progress=False, device="cpu", dtype="float32", quantization=method)


@pytest.mark.slow
def test_int8_greedy_leaves_the_float_path_only_at_near_ties(llm):
    base, quant = _greedy(llm), _greedy(_quantized_llm("int8"))
    matched = 0
    for question, b, q in zip(QUESTIONS, base, quant):
        for i, (expected, got) in enumerate(zip(b.token_ids, q.token_ids)):
            if expected != got:
                first, second = sorted(b.logprobs[i].values(), reverse=True)[:2]
                assert first - second < NEAR_TIE_NATS, f"{question!r}: int8 left a clear choice at token {i}"
                break
            matched += 1
    assert matched >= 0.6 * sum(len(b.token_ids) for b in base)


@pytest.mark.slow
def test_int4_takes_the_gguf_q4_1_blocks_bit_for_bit(llm):
    int4 = _quantized_llm("int4")
    float_model = llm.engine.runner.model
    layers = [(name, m) for name, m in int4.engine.runner.model.named_modules() if isinstance(m, Int4Linear)]
    assert len(layers) == 4 * float_model.config.num_layers
    for name, layer in layers:  # fused q|k|v and gate|up, Q/K rows unpermuted: all as the float loader has them
        weight = layer.int4_weight()  # (the engine's modules hold the fused step's layout: quant/kernel_layout.py)
        dequantized = dequantize_int4(weight.packed, weight.scales, weight.mins, weight.group_size)
        assert torch.equal(dequantized, float_model.get_submodule(name).weight), name
    # The CPU reference dequantizes every layer on every step, so the engine run stays short. Not the capital
    # question: its first token is a 0.08-nat tie in float32 ("The" / "L"), which int4's int8-block activations
    # tip (its prompt rows take the C step since issue 49 §2's invariance at one pass; bench/prefill_precision.py).
    params = SamplingParams(temperature=0, max_tokens=6)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS[1:3]]
    assert ([o.outputs[0].token_ids for o in int4.chat(prompts, params, use_tqdm=False)] ==
            [o.outputs[0].token_ids for o in llm.chat(prompts, params, use_tqdm=False)])


@pytest.mark.slow
@pytest.mark.parametrize("method", ["int8", "int4"])
def test_engine_on_the_triton_kernels_generates_the_torch_tokens(tiny_llama, monkeypatch, method):
    # A tiny random Llama keeps the interpreter's cost low; its logits are spread far from ties.
    def generate():
        llm = LLM(tiny_llama, show_progress=False, device=DEVICE, dtype="float32", quantization=method)
        outputs = llm.generate([list(range(300, 340)), [7, 8, 9]],
                               SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outputs]

    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    expected = generate()
    monkeypatch.setenv("KAON_QUANT_KERNEL", "triton")
    assert generate() == expected


def test_narrow_weights_on_cpu_keep_float16_keys_and_values_unless_told_otherwise(tiny_llama, monkeypatch):
    """kv_cache_dtype "auto": float16 under int8/int4 on CPU (twice the blocks for the same bytes),
    the model's dtype otherwise; an explicit choice wins, and a float16 cache serves the float
    model too. The fused C step and the torch path (its chunked prefills reading earlier chunks
    back from the cache) give the same tokens from a float16 cache."""
    def engine(**options):
        return LLM(tiny_llama, show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=1 << 22,
                   block_size=8, max_num_batched_tokens=32, **options)

    runners = {name: engine(**options).engine.runner for name, options in {
        "float": {}, "int8": dict(quantization="int8"), "int4": dict(quantization="int4"),
        "int8, float32 cache": dict(quantization="int8", kv_cache_dtype="float32")}.items()}
    assert {name: r.kv_cache.dtype for name, r in runners.items()} == {
        "float": torch.float32, "int8": torch.float16, "int4": torch.float16, "int8, float32 cache": torch.float32}
    assert runners["int8"].num_blocks == 2 * runners["int8, float32 cache"].num_blocks

    prompts = [list(range(300, 374)), list(range(300, 340)) + [5, 6, 7], [7, 8, 9]]  # the second shares blocks

    def generate(**options):
        llm = engine(kv_cache_dtype="float16", **options)
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outputs]

    llm, fused = generate()
    assert llm.engine.runner.cpu_decode_step and llm.engine.runner.kv_cache.dtype == torch.float16
    monkeypatch.setattr(cpu_decode, "library", lambda: None)  # as without a C compiler
    llm, torch_path = generate()
    assert not llm.engine.runner.cpu_decode_step
    assert fused == torch_path


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_narrow_weights_in_a_half_model_take_the_c_step_and_answer_alike_alone_batched_chunked(
        tiny_llama, dtype, method, monkeypatch):
    """--dtype bfloat16/float16 with int8/int4 weights runs the fused C step (issue 49 §2; torch's path
    before, whose prompt rows' sums moved with the row count): a prompt's tokens and log-probabilities
    are the same bits alone, in a batch, in prefill chunks and with its prefix cached. (The bundled
    model's run is tests/unit/runtime/engine/test_batch_invariance.py's, marked slow.)"""
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    _assert_the_c_step_answers_alike_alone_batched_chunked(
        lambda **options: LLM(tiny_llama, show_progress=False, device="cpu", dtype=dtype, quantization=method,
                              kv_cache_bytes=1 << 22, block_size=8, **options),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))


def _assert_the_c_step_answers_alike_alone_batched_chunked(engine, params) -> None:
    """engine(**options) runs the fused C step, and each of TINY_PROMPTS gets the same tokens and log-probabilities
    alone, in a batch, in prefill chunks of 16 and with its prefix cached."""
    def answers(llm, prompts):
        completions = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return [(c.token_ids, [step[t] for t, step in zip(c.token_ids, c.logprobs)]) for c in completions]

    plain = engine(enable_prefix_caching=False)
    assert plain.engine.runner.cpu_decode_step, "the fused C step runs this model"
    alone = [answers(plain, [p])[0] for p in TINY_PROMPTS]
    assert answers(plain, TINY_PROMPTS) == alone, "in a batch"
    plain.close()
    chunked = engine(enable_prefix_caching=True, max_num_batched_tokens=16)
    assert answers(chunked, TINY_PROMPTS) == alone, "in chunks of 16, batched"
    assert [answers(chunked, [p])[0] for p in TINY_PROMPTS] == alone, "with its prefix cached"
    chunked.close()


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
def test_fp8_weights_take_the_c_step_answer_alike_alone_batched_chunked_and_near_torchs(tiny_llama, monkeypatch):
    """--quantization fp8 runs the fused C step (issue 49 §2; torch's GEMMs before, whose prompt rows'
    sums moved with the row count): a prompt's tokens and log-probabilities are the same bits alone, in a
    batch, in prefill chunks and with its prefix cached. Its first step's log-probabilities are torch's
    path's (the step off, as without a C compiler: Fp8Linear's float32 matmul) but for the summation order
    and the vocabulary head, which is an int8 copy under every method: the C kernel's int8 activation blocks
    against torch's kernels, so both read it at their precise setting here (two passes; the dequantizing
    reference, KAON_QUANT_KERNEL=torch)."""
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS", "KAON_QUANT_KERNEL"):
        monkeypatch.delenv(name, raising=False)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5)

    def engine(**options):
        return LLM(tiny_llama, show_progress=False, device="cpu", quantization="fp8", kv_cache_bytes=1 << 22,
                   block_size=8, **options)

    def first_logprobs(llm):
        first = [o.outputs[0].logprobs[0] for o in llm.generate(TINY_PROMPTS, params, use_tqdm=False)]
        llm.close()
        return first

    _assert_the_c_step_answers_alike_alone_batched_chunked(engine, params)
    monkeypatch.setenv("KAON_CPU_ACTIVATIONS", "int8x2")
    ours = first_logprobs(engine())
    monkeypatch.setenv("KAON_QUANT_KERNEL", "torch")
    monkeypatch.setattr(cpu_decode, "library", lambda: None)  # the step off: torch's path
    torch_path = engine()
    assert not torch_path.engine.runner.cpu_decode_step
    for mine, theirs in zip(ours, first_logprobs(torch_path)):
        assert max(theirs, key=theirs.get) == max(mine, key=mine.get)
        assert max(abs(mine[t] - theirs[t]) for t in mine.keys() & theirs.keys()) < 1e-3


def test_an_unknown_kv_cache_dtype_is_refused():
    with pytest.raises(InvalidRequestError, match="kv_cache_dtype must be one of auto, float32, float16, bfloat16"):
        EngineConfig(kv_cache_dtype="int8")



FP8_CHECKPOINTS = {  # compressed-tensors weights, input activations (static: their scale) -> the linear kaon keeps
    "block": (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
              None, "Fp8BlockLinear"),
    "static": (dict(num_bits=8, type="float", symmetric=True, strategy="channel"),
               dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False), "StaticInputLinear"),
    "block-static": (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
                     dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False),
                     "StaticInputLinear"),
}


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
@pytest.mark.parametrize("case", sorted(FP8_CHECKPOINTS))
def test_block_and_static_fp8_checkpoints_take_the_c_step_and_answer_alike_alone_batched_chunked(
        case, tmp_path, gguf_path, monkeypatch):
    """A block-scaled FP8 checkpoint (128 x 128), an FP8 one with static input scales and a block-scaled one
    with static input scales, written by compressed-tensors, run the fused C step in the default precision
    (issue 49 §2; torch's path before, whose prompt rows' sums moved with the row count): a prompt's tokens
    and log-probabilities are the same bits alone, in a batch, in prefill chunks and with its prefix cached.
    (`--dtype float32`, the reference mode, takes the C step too: test_reference_arithmetic.py.)"""
    pytest.importorskip("compressed_tensors")
    from support.quantized_dirs import add_input_scales, write_compressed_tensors

    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    weights, activations, kept = FP8_CHECKPOINTS[case]
    write_compressed_tensors(tmp_path, gguf_path, weights, "float-quantized")
    if activations is not None:
        add_input_scales(tmp_path, activations, 0.004)

    def engine(**options):
        llm = LLM(str(tmp_path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22, block_size=8, **options)
        assert type(llm.engine.runner.model.model.layers[0].mlp.gate_up_proj).__name__ == kept
        return llm

    _assert_the_c_step_answers_alike_alone_batched_chunked(
        engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
