"""Prompt logprobs (what evaluation harnesses score with) equal transformers' on the same prompt."""
from __future__ import annotations

import pytest
import torch

from kaon_runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow  # transformers' model loaded and compared (make unit leaves it out)

PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid."


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_equal_transformers_and_max_tokens_0_generates_nothing(llm, hf_model):
    ids = llm.tokenizer.encode(PROMPT)
    out = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=3), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    scored = out.prompt_logprobs
    assert scored is not None and len(scored) == len(ids) and scored[0] is None
    reference = hf_logprobs(hf_model, ids)
    for p in range(1, len(ids)):
        entry = scored[p]
        assert abs(entry[ids[p]] - reference[p - 1, ids[p]].item()) < 1e-4, p
        top = reference[p - 1].topk(3)
        assert set(top.indices.tolist()) <= set(entry), p


def test_prompt_logprobs_survive_chunked_prefill_and_come_with_generation(llm):
    ids = llm.tokenizer.encode(PROMPT * 3)
    whole = llm.generate([ids], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)[0].prompt_logprobs
    engine = llm.engine
    budget = engine.scheduler.max_num_batched_tokens
    engine.scheduler.max_num_batched_tokens = 16  # the prompt goes in several chunks
    try:
        chunked = llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0),
                               use_tqdm=False)[0]
    finally:
        engine.scheduler.max_num_batched_tokens = budget
    assert len(chunked.outputs[0].token_ids) == 3
    for a, b in zip(whole[1:], chunked.prompt_logprobs[1:]):
        assert a.keys() == b.keys() and all(abs(a[t] - b[t]) < 1e-4 for t in a)
