"""vLLM's request extensions through the real engine: min_tokens, logit_bias, stop strings kept."""
from __future__ import annotations

import pytest

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.sampling import SamplingParams

PROMPT = [{"role": "user", "content": "Hi"}]


def chat(llm, params):
    return llm.chat(PROMPT, params, use_tqdm=False)[0].outputs[0]


def test_min_tokens_holds_eos_and_stop_ids_back(llm):
    short = chat(llm, SamplingParams(temperature=0, max_tokens=200))
    assert short.finish_reason == "stop" and short.token_ids[-1] in llm.tokenizer.eos_token_ids
    at_least = len(short.token_ids) + 5
    longer = chat(llm, SamplingParams(temperature=0, max_tokens=200, min_tokens=at_least))
    assert len(longer.token_ids) >= at_least
    assert not set(longer.token_ids[:at_least - 1]) & set(llm.tokenizer.eos_token_ids)
    first = short.token_ids[0]
    held = chat(llm, SamplingParams(temperature=0, max_tokens=3, min_tokens=3, stop_token_ids=[first]))
    assert len(held.token_ids) == 3 and first not in held.token_ids


def test_logit_bias_steers_and_is_checked_against_the_vocabulary(llm):
    forced = chat(llm, SamplingParams(temperature=0, max_tokens=4, logit_bias={42: 100}))
    assert forced.token_ids == [42] * 4
    seeded = chat(llm, SamplingParams(temperature=1.0, seed=3, max_tokens=4, logit_bias={42: 100}))
    assert seeded.token_ids == [42] * 4
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.engine.validate("Hi", SamplingParams(logit_bias={llm.engine.model_config.vocab_size: 1}))
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.engine.validate("Hi", SamplingParams(stop_token_ids=[10 ** 9]))


def test_include_stop_str_in_output(llm):
    full = chat(llm, SamplingParams(temperature=0, max_tokens=40)).text
    stop = full.split()[3]
    kept = chat(llm, SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True))
    assert kept.finish_reason == "stop" and kept.text == full[:full.index(stop) + len(stop)]
