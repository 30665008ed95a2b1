"""The engine on the Triton backend (interpreted when there is no GPU) generates the torch backend's tokens.

A tiny random Llama keeps the interpreter's cost low. The batch covers what the kernels
must get right inside the engine: chunked prefill next to decodes, prefix-cache hits
(a chunk that starts after cached blocks), GQA, and contexts spanning several blocks.
On a GPU the bundled model also runs in bfloat16 on both backends over the correctness prompts.
"""
from __future__ import annotations

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.kernels import paged_attention
from support import MODEL
from support.prompts import MAX_TOKENS, QUESTIONS, chat_ids
from support.tiny_llama import DEVICE, PROMPTS

transformers = pytest.importorskip("transformers")


def _generate(path: str) -> tuple[LLM, list[list[int]]]:
    # Batches of at most 32 tokens: the 74-token prompt is prefilled in chunks while the others decode.
    llm = LLM(path, show_progress=False, device=DEVICE, dtype="float32", block_size=8, max_num_batched_tokens=32)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("split_kv", [False, True], ids=["whole-context", "split-kv"])
def test_triton_backend_generates_the_torch_tokens(tiny_llama, monkeypatch, split_kv):
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "torch")
    _, expected = _generate(tiny_llama)
    monkeypatch.setenv("KAON_ATTENTION_BACKEND", "triton")
    if split_kv:  # the interpreter never splits on its own: force 16-key partitions so decodes merge partials
        monkeypatch.setattr(paged_attention, "_auto_partition", lambda programs, max_len, device: 16)
    llm, tokens = _generate(tiny_llama)
    layer = llm.engine.runner.model.model.layers[0]
    assert layer.self_attn.attn.backend.name == "triton" and layer.input_layernorm.kernel is not None
    assert llm.engine.block_manager.prefix_hits > 0
    assert tokens == expected


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 needs compiled kernels (the interpreter's bf16 dot is wrong)")
def test_triton_backend_generates_the_torch_tokens_in_bf16_on_the_correctness_prompts(monkeypatch):
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KAON_ATTENTION_BACKEND", backend)
        llm = LLM(MODEL, show_progress=False, device="cuda", dtype="bfloat16")
        prompts = [chat_ids(llm, q) for q in QUESTIONS]
        outputs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["triton"] == tokens["torch"]
