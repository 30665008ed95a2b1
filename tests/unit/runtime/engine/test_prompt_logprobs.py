"""Prompt logprobs (what evaluation harnesses score with) survive chunked prefill; that they equal
transformers' on the same prompt is tests/unit/runtime/test_correctness.py's (where HF's model is loaded
anyway: loading it in a second file made the other xdist worker load it again, ~22 CPU s)."""
from __future__ import annotations

import pytest

from kaon_runtime.sampling import SamplingParams

pytestmark = pytest.mark.slow  # the bundled model generating (make unit leaves it out)

PROMPT = "The capital of France is Paris. The capital of Italy is Rome, and the capital of Spain is Madrid."


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
