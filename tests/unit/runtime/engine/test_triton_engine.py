"""The engine on the Triton backend (interpreted when there is no GPU) generates the torch backend's tokens.

A tiny random Llama keeps the interpreter's cost low. The batch covers what the kernels
must get right inside the engine: chunked prefill next to decodes, prefix-cache hits
(a chunk that starts after cached blocks), GQA, and contexts spanning several blocks.
On a GPU the model, its weights spread, also runs in bfloat16 on both backends (support.tiny_llama.spread_copy).
"""
from __future__ import annotations

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import paged_attention
from support.tiny_llama import DEVICE, PROMPTS, first_difference_at_a_near_tie, spread_copy

pytestmark = pytest.mark.slow  # whole models generating on Triton's interpreter (make unit leaves it out)

transformers = pytest.importorskip("transformers")


def _generate(path: str) -> tuple[LLM, list[list[int]]]:
    # Batches of at most 32 tokens: the 74-token prompt is prefilled in chunks while the others decode.
    llm = LLM(path, show_progress=False, device=DEVICE, dtype="float32", block_size=8, max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("split_kv,c_step", [(False, True), (True, True), (True, False)],
                         ids=["whole-context", "split-kv", "split-kv-triton-decodes"])
def test_triton_backend_generates_the_torch_tokens(tiny_llama, monkeypatch, split_kv, c_step):
    if not c_step and DEVICE == "cuda":
        pytest.skip("no C step on a GPU: split-kv already decodes through Triton (lease time saved)")
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "torch")
    _, expected = _generate(tiny_llama)
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "triton")
    if not c_step:  # float32 decodes on CPU go to the fused C step: off, so Triton decodes as on a GPU
        from kaon_runtime.engine import model_loader
        select = model_loader.select_kernels
        monkeypatch.setattr(model_loader, "select_kernels", lambda device, *_, **__: select(device, False))
    if split_kv:  # the interpreter never splits on its own: force 16-key partitions so decodes merge partials
        monkeypatch.setattr(paged_attention, "_auto_partition", lambda programs, max_len, device: 16)
    llm, tokens = _generate(tiny_llama)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.attn.backend.name == "triton" and layer.input_layernorm.kernel is not None
    # The C step takes float32 decodes on CPU only; on a GPU Triton decodes whatever c_step says.
    assert (llm.engine.runner.model.model.cpu_decode is None) == (not c_step or DEVICE == "cuda")
    assert llm.engine.block_manager.prefix_hits > 0
    assert tokens == expected


# bf16 keeps 8 bits of a logit: one of 10 is rounded to 0.0625. Kernels summing in other orders part
# only where the top two are within a few such steps.
BF16_NEAR_TIE = 0.25


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 needs compiled kernels (the interpreter's bf16 dot is wrong)")
def test_triton_backend_generates_the_torch_tokens_in_bf16(tiny_llama, tmp_path, monkeypatch):
    path = spread_copy(tiny_llama, tmp_path / "spread")  # not the bundled model: it runs on a lent GPU too
    outputs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KAON_ATTENTION_BACKEND", backend)
        llm = LLM(path, show_progress=False, device="cuda", dtype="bfloat16")
        assert llm.engine.runner.model.model.layers[0].self_attn.attn.backend.name == backend
        params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)
        outputs[backend] = llm.generate(PROMPTS, params, use_tqdm=False)
    first_difference_at_a_near_tie(outputs["torch"], [o.outputs[0].token_ids for o in outputs["triton"]],
                                   BF16_NEAR_TIE)
