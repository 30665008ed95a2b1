"""GGUF files of every family beyond Llama/Qwen, written the way llama.cpp's converter writes them
(support/gguf_from_hf.py): Gemma 2 (norms with +1 folded in, soft-caps and windows in metadata),
Phi-3 (fused q|k|v and gate|up, LongRoPE factor tensors, partial rotary), Mixtral (llama with 3-D
experts) and Qwen3-MoE. Q8_0 weights; kaon's greedy tokens in float32 equal transformers' on the
dequantized weights, and the file also loads kept quantized (the default on CPU, experts included) and
decodes as llama.cpp does the same file: each of kaon's greedy tokens is llama.cpp's greedy choice on
the same tokens, or within NEAR_TIE of it (both quantize activations, each its own way).
llama-cpp-python comes from e2e/build-llama-cpp.sh, which `make test` runs beside tests/unit; the
agreement test is marked llama_cpp, and `make test` runs it after that build instead of in tests/unit
(a cold build kept a unit worker waiting ~10 min). Run alone, it runs the script itself (returns at once
when the wheel is installed, else installs the cached wheel or builds it); in CI its absence fails."""
from __future__ import annotations

import functools
import importlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.loader import open_checkpoint
from support.gguf_from_hf import dequantized_reference, write_gguf_from_hf

pytestmark = pytest.mark.slow  # whole models, and the bundled 49k-token tokenizer
transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

SMALL = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.3, 1.9, 2.6], "long_factor": [1.5, 3.0, 7.0, 16.0]}
FAMILIES = {
    # llama.cpp scales Gemma 2's queries by the head size (hidden / heads for the 27B): so does this model
    "gemma2": ("Gemma2", dict(sliding_window=24, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                              final_logit_softcapping=3.0, hidden_activation="gelu_pytorch_tanh")),
    # Both prompts are longer than the pretraining length (32): HF and kaon use the long factors.
    "phi3": ("Phi3", dict(original_max_position_embeddings=32, partial_rotary_factor=0.5, sliding_window=24,
                          rope_parameters=LONGROPE, pad_token_id=0)),
    "mixtral": ("Mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3Moe", dict(num_experts=5, num_experts_per_tok=2, moe_intermediate_size=32,
                                   norm_topk_prob=True)),
}
PROMPTS = [[1, *range(300, 340)], [1, 42, 4242, 9000, 12, 7, *range(1000, 1034)]]  # longer than the windows
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
# kaon's kept Q8_0 path quantizes activations in int8 blocks of 32, llama.cpp in its own Q8 blocks:
# the logits differ by a few hundredths, so at a near-tie each may pick the other's runner-up (measured
# 2026-11-29, llama-cpp-python 0.3.36, Gemma 2, Mixtral, Qwen3-MoE: 69 of 72 tokens its first choice, 0.017,
# 0.036 and 0.055 below it, where its top two were that close). 0.15: about three times that.
NEAR_TIE = 0.15


def _hf_model(family: str):
    prefix, extra = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, f"{prefix}Config")(**{**SMALL, **extra})
    config._attn_implementation = "eager"  # SDPA in HF ignores Gemma 2's soft-capping
    model = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():  # weights spread so that greedy choices are far from ties; norms away from 1 (or 0)
        for _name, p in model.named_parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    return model


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=GREEDY.max_tokens, min_new_tokens=GREEDY.max_tokens, do_sample=False,
                             pad_token_id=2)
    return out[0, len(prompt):].tolist()


def _kaon_greedy(path, **options) -> list[list[int]]:
    llm = LLM(str(path), show_progress=False, device="cpu", kv_cache_bytes=1 << 22, **options)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY)]


BUILD_LLAMA_CPP = Path(__file__).resolve().parents[4] / "e2e" / "build-llama-cpp.sh"


@functools.cache  # the script once per session (a failure raises, and is not cached)
def _llama_cpp():
    # The build script returns at once when the wheel is installed; under `make test` it waits for
    # the build running beside tests/unit; else it builds (minutes) or installs the cached wheel.
    build = subprocess.run(["bash", str(BUILD_LLAMA_CPP)], env={**os.environ, "PY": sys.executable},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    importlib.invalidate_caches()  # installed by the script meanwhile: let the import find it
    try:
        import llama_cpp
    except ImportError:
        missing = (f"llama-cpp-python is not installed (e2e/build-llama-cpp.sh exited {build.returncode}):\n"
                   f"{build.stdout[-2000:]}")
        if os.environ.get("CI"):
            pytest.fail(missing)
        pytest.skip(missing)
    return llama_cpp


def _llama_cpp_logits(path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """llama.cpp's logits before each of `tokens`, prompt + tokens fed at once (teacher-forced)."""
    llm = _llama_cpp().Llama(str(path), n_ctx=256, logits_all=True, verbose=False)
    llm.eval(prompt + tokens)
    return torch.from_numpy(llm.scores[len(prompt) - 1:len(prompt) + len(tokens) - 1].copy())


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_gguf(request, tmp_path_factory, gguf_path):
    model = _hf_model(request.param)
    path = write_gguf_from_hf(model, tmp_path_factory.mktemp(request.param) / "model.gguf", gguf_path, "Q8_0")
    return request.param, path, dequantized_reference(model, "Q8_0")


def test_config_is_the_family_of_the_file(family_gguf):
    family, path, model = family_gguf
    checkpoint = open_checkpoint(str(path))
    config = checkpoint.config
    assert config.architecture == family
    assert config.num_experts == (getattr(model.config, "num_local_experts", None)
                                  or getattr(model.config, "num_experts", 0) or 0)
    # The experts' blocks are offered too, to be kept quantized (tests/unit/runtime/quant/test_quantized_experts.py)
    experts = {name for name, _, _ in checkpoint.quantized_blocks() if ".experts." in name}
    assert len(experts) == 2 * 3 * config.num_experts


def test_float32_greedy_tokens_equal_transformers_on_the_dequantized_weights(family_gguf):
    _family, path, model = family_gguf
    assert _kaon_greedy(path, dtype="float32") == [_hf_greedy(model, p) for p in PROMPTS]


@pytest.mark.llama_cpp  # `make test` runs it after the builds (the Makefile says why)
def test_kept_quantized_decodes_and_agrees_with_llama_cpp(family_gguf, request):
    family, path, _model = family_gguf
    if family == "phi3":
        # Not a near-tie: kaon's tokens are 0.2 to 8 below llama.cpp's best at almost every step, while
        # kaon's float32 tokens equal transformers' on this file (the test above). Which part of the file
        # (LongRoPE factors past the 32-token pretraining length, partial rotary) llama.cpp reads
        # otherwise is not found yet; strict: this fails once they agree, to be turned back on.
        request.applymarker(pytest.mark.xfail(strict=True, reason="llama.cpp disagrees with transformers on it"))
    ours = _kaon_greedy(path)  # the default on CPU: the file's own Q8_0 blocks
    assert all(len(tokens) == GREEDY.max_tokens for tokens in ours)
    for prompt, tokens in zip(PROMPTS, ours):
        logits = _llama_cpp_logits(path, prompt, tokens)
        below = logits.max(dim=1).values - logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
        assert float(below.max()) <= NEAR_TIE, f"{family}: kaon's tokens below llama.cpp's best by {below.tolist()}"
