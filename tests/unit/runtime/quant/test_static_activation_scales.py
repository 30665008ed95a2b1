"""compressed-tensors checkpoints with static activation quantization (`input_activations`, dynamic
false: an `input_scale` per linear) are applied, and a `kv_cache_scheme` loads with a warning.

The reference is transformers on the same directory (weights decompressed to float32) with each
quantized linear's input rounded to the checkpoint's grid by a forward hook written here from the
compressed-tensors spec; kaon's greedy tokens must equal it, and differ from the unrounded model's
(so a loader that dropped the scales would fail)."""
from __future__ import annotations

import json

import pytest
import torch
from test_quant import _assert_the_c_step_answers_alike_alone_batched_chunked
from torch import nn

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import ModelLoadError
from kaon_runtime.kernels import cpu_decode
from kaon_runtime.quant.static_inputs import StaticInputLinear
from support.quantized_dirs import (
    add_input_scales,
    greedy,
    transformers_reference,
    update_config,
    write_compressed_tensors,
)

pytestmark = pytest.mark.slow  # whole quantized checkpoints loaded (make unit leaves it out)

pytest.importorskip("compressed_tensors")
PROMPTS = [[1, 500, 600, 700], [1, 42, 4242, 9000, 12, 7]]
TOKENS = 10
CASES = {  # weights, format, input activations, their scale (coarse: rounding changes the greedy tokens)
    "fp8": (dict(num_bits=8, type="float", symmetric=True, strategy="tensor"), "float-quantized",
            dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False), 0.004),
    "fp8-block": (dict(num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]),
                  "float-quantized", dict(num_bits=8, type="float", symmetric=True, strategy="tensor", dynamic=False),
                  0.004),
    "int8": (dict(num_bits=8, type="int", symmetric=True, strategy="channel"), "int-quantized",
             dict(num_bits=8, type="int", symmetric=True, strategy="tensor", dynamic=False), 0.05),
}


def _round_inputs(model: nn.Module, kind: str, scale: float) -> None:
    """The spec's static quantization of every quantized linear's input, as forward pre-hooks."""
    def hook(_module, args):
        x = args[0] / scale
        q = x.clamp(-448, 448).to(torch.float8_e4m3fn).float() if kind.startswith("fp8") else x.round().clamp(-128, 127)
        return (q * scale,)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name != "lm_head":
            module.register_forward_pre_hook(hook)


def _generate(path) -> tuple[LLM, list[list[int]]]:
    llm = LLM(str(path), show_progress=False, device="cpu", dtype="float32", kv_cache_bytes=1 << 22)
    greedy_params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return llm, [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy_params)]


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(CASES))
def test_static_input_scales_are_applied(case, tmp_path, gguf_path):
    weights, fmt, activations, scale = CASES[case]
    write_compressed_tensors(tmp_path, gguf_path, weights, fmt)
    reference = transformers_reference(tmp_path)
    unrounded = [greedy(reference, prompt, TOKENS) for prompt in PROMPTS]
    add_input_scales(tmp_path, activations, scale)
    _round_inputs(reference, case, scale)
    expected = [greedy(reference, prompt, TOKENS) for prompt in PROMPTS]
    llm, tokens = _generate(tmp_path)
    assert isinstance(llm.engine.runner.model.model.layers[0].mlp.gate_up_proj, StaticInputLinear)
    assert tokens == expected
    assert expected != unrounded  # the scales matter: a loader that dropped them would fail


def test_a_kv_cache_scheme_loads_with_a_warning_and_its_scales_unused(tmp_path, gguf_path, caplog):
    """As llm-compressor writes an FP8 KV cache: the scheme in the config, k_scale / v_scale on every
    attention; the tokens are those of the same checkpoint without it."""
    from safetensors.torch import load_file, save_file

    write_compressed_tensors(tmp_path, gguf_path, CASES["fp8"][0], "float-quantized")
    _, expected = _generate(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    config["kv_cache_scheme"] = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    update_config(tmp_path, quantization_config=config)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        for name in ("k_scale", "v_scale"):
            tensors[f"model.layers.{layer}.self_attn.{name}"] = torch.tensor([0.05])
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level("WARNING"):
        _, tokens = _generate(tmp_path)
    assert tokens == expected
    assert any("kv_cache_scheme" in r.getMessage() for r in caplog.records)


def test_a_missing_input_scale_is_named(tmp_path, gguf_path):
    from safetensors.torch import load_file, save_file

    write_compressed_tensors(tmp_path, gguf_path, CASES["fp8"][0], "float-quantized")
    add_input_scales(tmp_path, CASES["fp8"][2], 0.01)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.down_proj.input_scale"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.input_scale is missing"):
        LLM(str(tmp_path), show_progress=False, device="cpu")


@pytest.mark.skipif(cpu_decode.compiler() is None, reason=cpu_decode.NO_COMPILER)
def test_static_int8_takes_the_c_step_and_answers_alike_alone_batched_chunked(tmp_path, gguf_path, monkeypatch):
    """By default a W8A8 int8 checkpoint with static input scales runs the fused C step (kind INT8_S8: the
    grid's rounding, exact int32 sums, one row at a time; issue 49 §2): a prompt's tokens and
    log-probabilities are the same bits alone, in a batch, in prefill chunks and with its prefix cached."""
    for name in ("KAON_CPU_PREFILL", "KAON_CPU_DECODE", "KAON_CPU_ACTIVATIONS"):
        monkeypatch.delenv(name, raising=False)
    weights, fmt, activations, scale = CASES["int8"]
    write_compressed_tensors(tmp_path, gguf_path, weights, fmt)
    add_input_scales(tmp_path, activations, scale)
    _assert_the_c_step_answers_alike_alone_batched_chunked(
        lambda **options: LLM(str(tmp_path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22,
                              block_size=8, **options),
        SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))
