"""`--dtype float32` on a quantized checkpoint computes what the checkpoint specifies (issue 49 §1).

The fast default changes a weight-only checkpoint's activations (bfloat16 into torch's int4/int8
kernels, int8 in blocks of 32 in the fused C step), which the format does not specify. The reference
mode multiplies float32 activations by the dequantized weights and applies only the activation
quantization the checkpoint asks for. Whole-model agreement with transformers for every
compressed-tensors, GPTQ and AWQ layout is in test_quantized_checkpoints.py, test_quantized_experts.py,
test_static_activation_scales.py and test_dynamic_activations.py (all through `dtype="float32"`);
this file has the FP8-dynamic layout, the per-token FP8 rounding against compressed-tensors' own, and
which mode each dtype selects.
"""
from __future__ import annotations

import json

import pytest
import torch
from test_quant import _assert_the_c_step_answers_alike_alone_batched_chunked

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.models.fused_weights import linear_weights
from kaon_runtime.quant.dynamic_fp8 import DynamicFp8InputLinear, round_to_fp8_per_token
from kaon_runtime.quant.linear import QuantizedLinear
from support.quantized_dirs import transformers_reference, update_config, write_compressed_tensors, write_packed_dir

pytest.importorskip("compressed_tensors")
PROMPTS = [list(range(100, 120)), [5, 9, 300, 4000, 17], list(range(2000, 2030, 3))]
TOKENS = 10
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
FP8_CHANNEL = dict(num_bits=8, type="float", symmetric=True, strategy="channel")
TOKEN_FP8 = dict(num_bits=8, type="float", symmetric=True, strategy="token", dynamic=True)


def test_per_token_fp8_rounding_is_compressed_tensors_own():
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    x = torch.randn(7, 96) * torch.logspace(-3, 2, 7)[:, None]
    x[3] = 0  # a zero row: the spec's eps scale
    args = QuantizationArgs(**TOKEN_FP8)
    scale, zero = calculate_qparams(x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True), args)
    expected = fake_quantize(x, scale, zero, args)
    assert torch.equal(round_to_fp8_per_token(x), expected)
    assert not torch.equal(expected, x)  # the rounding is real: a pass-through would fail


def _fp8_dynamic_dir(path, gguf_path) -> None:
    write_compressed_tensors(path, gguf_path, FP8_CHANNEL, "float-quantized")
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    config["config_groups"]["group_0"]["input_activations"] = TOKEN_FP8
    update_config(path, quantization_config=config)


def _transformers_quantizing_inputs(path):
    """transformers keeping compressed-tensors' scheme on each linear (run_compressed): its forward rounds
    each token's input to FP8; `transformers_reference` (decompressed to float) drops the scheme."""
    import transformers

    quant = transformers.CompressedTensorsConfig(run_compressed=True)
    return transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=quant,
                                                             dtype=torch.float32).eval()


def _greedy_hf(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False, pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _kaon(path, dtype: str) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), show_progress=False, device="cpu", dtype=dtype, kv_cache_bytes=1 << 22)
    return llm, [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.slow
def test_fp8_dynamic_rounds_each_token_as_transformers_does(tmp_path, gguf_path):
    pytest.importorskip("transformers")
    _fp8_dynamic_dir(tmp_path, gguf_path)
    reference = _transformers_quantizing_inputs(tmp_path)
    expected = [_greedy_hf(reference, prompt) for prompt in PROMPTS]
    # The activation rounding matters on these prompts: a loader that skipped it (weight-only) would fail.
    assert expected != [_greedy_hf(transformers_reference(tmp_path), prompt) for prompt in PROMPTS]
    llm, tokens = _kaon(tmp_path, "float32")
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.gate_up_proj, DynamicFp8InputLinear)
    assert tokens == expected


@pytest.mark.slow
def test_float32_selects_the_reference_and_the_default_keeps_the_fast_kernels(tmp_path, gguf_path):
    """W4A16 (GPTQ-style groups of 32): both run the fused C step; the default reads the weights in its fast
    kinds (int8 activation blocks), --dtype float32 in its reference kinds (float32 activations times the exactly
    dequantized weights). The tokens themselves are checked against transformers in test_quantized_checkpoints.py."""
    write_compressed_tensors(tmp_path, gguf_path, dict(num_bits=4, type="int", symmetric=True, strategy="group",
                                                       group_size=32), "pack-quantized")
    for dtype, reference in (("auto", False), ("float32", True)):
        llm = LLM(str(tmp_path), show_progress=False, device="cpu", dtype=dtype, kv_cache_bytes=1 << 22)
        linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, QuantizedLinear)]
        assert len(linears) == 2 * 4  # two layers' qkv, o, gate|up, down
        assert all(m.reference is reference for m in linears), dtype
        assert llm.engine.runner.kernels.cpu_decode, dtype
        assert _step_kinds(llm) == ({cpu_decode.KIND_REF_Q4} if reference else {cpu_decode.KIND_Q4_F32}), dtype
        llm.close()


def _step_kinds(llm: LLM) -> set[int]:
    """The C kinds the fused step reads the model's projections with."""
    layers = llm.engine.runner.model.model.fused_weights().layers
    return {linear_weights(m).struct.kind for layer in layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)}


# Weight-only checkpoints whose reference mode takes the C step's four reference kinds, act-order included
REFERENCE_DIRS = {
    "gptq-4bit-g64-asym-actorder": (("gptq", 4, 64, False, True), cpu_decode.KIND_REF_Q4),
    "gptq-8bit-g32-asym": (("gptq", 8, 32, False, False), cpu_decode.KIND_REF_Q8_G16),
    # 8-bit groups that are not a multiple of 16 (Q8_G16 cannot hold them): read as the module holds them
    "gptq-8bit-g8-asym-actorder": (("gptq", 8, 8, False, True), cpu_decode.KIND_REF_Q8_G),
    "w8a16-channel": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), cpu_decode.KIND_REF_INT8),
}


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
@pytest.mark.parametrize("case", sorted(REFERENCE_DIRS))
def test_the_reference_mode_takes_the_c_step_and_answers_alike_alone_batched_chunked(
        case, tmp_path, gguf_path, monkeypatch):
    """--dtype float32 on a weight-only checkpoint runs the fused C step's reference kinds (issue 49 §1 and §2;
    torch's reference GEMMs before, whose prompt rows' sums moved with the row count): a prompt's tokens and
    log-probabilities are the same bits alone, in a batch, in prefill chunks and with its prefix cached."""
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    layout, kind = REFERENCE_DIRS[case]
    if isinstance(layout, dict):
        write_compressed_tensors(tmp_path, gguf_path, layout, "pack-quantized")
    else:
        write_packed_dir(tmp_path, gguf_path, *layout)

    def engine(**options):
        llm = LLM(str(tmp_path), show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=1 << 22,
                  block_size=8, **options)
        assert _step_kinds(llm) == {kind}
        return llm

    _assert_the_c_step_answers_alike_alone_batched_chunked(
        engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
@pytest.mark.parametrize("layout", ["gptq", "compressed-tensors"])
def test_the_default_mode_reads_8bit_groups_that_are_not_multiples_of_16_in_the_c_step(layout, tmp_path, gguf_path,
                                                                                      monkeypatch):
    """Not only --dtype float32: by default too, an 8-bit checkpoint in groups of 8 (which Q8_G16 cannot hold: GPTQ,
    compressed-tensors W8A16 by group) takes the C step through REF_Q8_G (float32 activations) instead of torch's
    path, so its answers are the same alone, batched, chunked and with its prefix cached (issue 49 §2)."""
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    if layout == "gptq":
        write_packed_dir(tmp_path, gguf_path, "gptq", 8, 8, False, False)
    else:
        write_compressed_tensors(tmp_path, gguf_path, dict(num_bits=8, type="int", symmetric=True, strategy="group",
                                                           group_size=8), "pack-quantized")

    def engine(**options):
        llm = LLM(str(tmp_path), show_progress=False, device="cpu", dtype="auto", kv_cache_bytes=1 << 22,
                  block_size=8, **options)
        assert _step_kinds(llm) == {cpu_decode.KIND_REF_Q8_G}
        return llm

    _assert_the_c_step_answers_alike_alone_batched_chunked(
        engine, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
