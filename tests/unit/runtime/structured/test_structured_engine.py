"""Grammar-constrained decoding in the engine, on the real model: every output follows its grammar,
whatever the sampling, and the grammar state survives speculative decoding, preemption and
prefix-cache hits. Without the mask these fail: the model writes prose, not the choices or the JSON."""
from __future__ import annotations

import json
import re

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.errors import InvalidRequestError
from support.server import MODEL

# Whole models generating: `make test` runs these, `make unit` (the inner loop) leaves them out.
pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}$"},
    "age": {"type": "integer", "minimum": 18, "maximum": 99},
    "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "minItems": 1, "maxItems": 2}},
    "required": ["name", "age", "pets"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person in JSON with a name, an age and their pets."}]
# Asks for the JSON back, so prompt lookup finds drafts in the prompt.
ECHO = [{"role": "user", "content": 'Repeat this JSON exactly: {"name": "Alice", "age": 30, "pets": ["cat", "dog"]}'}]


def valid(text: str) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (set(value) == {"name", "age", "pets"} and re.fullmatch("[A-Z][a-z]{1,10}", value["name"]) is not None
            and 18 <= value["age"] <= 99 and 1 <= len(value["pets"]) <= 2
            and set(value["pets"]) <= {"cat", "dog", "fish"})


def texts(llm, conversation, params) -> list[str]:
    return [o.text for o in llm.chat(conversation, params, use_tqdm=False)[0].outputs]


def test_every_sampling_mode_keeps_to_the_grammar(llm):
    greedy = texts(llm, ASK, SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA))
    assert valid(greedy[0])
    assert texts(llm, ASK, SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA)) == greedy  # cache hit
    sampled = llm.chat(ASK, SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=4, n=2, max_tokens=60,
                                           logprobs=3, json_schema=SCHEMA), use_tqdm=False)[0]
    for out in sampled.outputs:
        assert out.finish_reason == "stop" and valid(out.text), out.text
        assert all(lp[token] > float("-inf") for token, lp in zip(out.token_ids, out.logprobs))
    choices = texts(llm, ASK, SamplingParams(temperature=1.5, seed=1, n=3, max_tokens=4, choice=["yes", "no"]))
    assert set(choices) <= {"yes", "no"}
    date = texts(llm, ASK, SamplingParams(temperature=0, max_tokens=20, regex=r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"))
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date[0])
    ebnf = 'root ::= "Alice is " [1-9] [0-9] " years old."'
    assert re.fullmatch(r"Alice is [1-9][0-9] years old\.", texts(llm, ASK, SamplingParams(
        temperature=1.0, seed=2, max_tokens=20, grammar=ebnf))[0])
    cut = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=5, json_schema=SCHEMA), use_tqdm=False)[0].outputs[0]
    assert cut.finish_reason == "length" and greedy[0].startswith(cut.text)


def test_rows_without_a_grammar_are_untouched(llm):
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = llm.chat(ASK, free, use_tqdm=False)[0].outputs[0].token_ids
    both = llm.generate([llm.tokenizer.apply_chat_template(ASK)] * 2,
                        [free, SamplingParams(temperature=0, max_tokens=24, json_schema=SCHEMA)], use_tqdm=False)
    assert both[0].outputs[0].token_ids == alone
    assert both[1].outputs[0].token_ids != alone


def test_speculative_decoding_and_preemption_keep_the_grammar_state(llm):
    """Prompt-lookup drafts walk the grammar forward and back; a pool this small preempts sequences
    (recomputed later, partly from the prefix cache). Greedy outputs match the plain engine's."""
    spec = LLM(MODEL, show_progress=False, device="cpu", dtype="float32", speculative_method="ngram",
               num_speculative_tokens=4, num_kv_blocks=10, block_size=16)
    prompts = [llm.tokenizer.apply_chat_template(c) for c in (ECHO, ASK, ECHO)]
    params = SamplingParams(temperature=0, max_tokens=60, json_schema=SCHEMA)
    plain = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert [o.outputs[0].text for o in spec.generate(prompts, params, use_tqdm=False)] == plain
    assert all(valid(t) for t in plain)
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0 and stats.num_preemptions > 0
    seeded = spec.generate(prompts, SamplingParams(temperature=1.0, seed=9, max_tokens=60, json_schema=SCHEMA),
                           use_tqdm=False)
    assert all(valid(o.outputs[0].text) for o in seeded)


def test_a_bad_constraint_is_refused_before_it_runs(llm):
    with pytest.raises(InvalidRequestError, match="unknown type 'strin'"):
        llm.generate(["x"], SamplingParams(json_schema={"type": "strin"}), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="regex cannot be compiled"):
        llm.generate(["x"], SamplingParams(regex="(("), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_vllms_structured_outputs_argument_is_the_same_constraint(llm):
    """vLLM's offline spelling, SamplingParams(structured_outputs=StructuredOutputsParams(json=...)) (here an
    object with those attributes, or a dict), was a TypeError."""
    class StructuredOutputsParams:  # vLLM's shape: json, regex, choice, grammar, json_object
        def __init__(self, **given):
            self.json = self.regex = self.choice = self.grammar = self.json_object = None
            self.__dict__.update(given)

    for given in (StructuredOutputsParams(json=SCHEMA), {"json": SCHEMA}):
        params = SamplingParams(temperature=0, max_tokens=24, structured_outputs=given)
        assert params.json_schema == SCHEMA and params.structured_outputs is None
    # The engine runs it as its own: the same tokens (24, enough to leave free text at its first one).
    assert texts(llm, ASK, params) == texts(llm, ASK, SamplingParams(temperature=0, max_tokens=24, json_schema=SCHEMA))
    assert SamplingParams(structured_outputs={"choice": ["yes", "no"]}).choice == ["yes", "no"]
    with pytest.raises(InvalidRequestError, match="unknown keys"):
        SamplingParams(structured_outputs={"jsn": SCHEMA})
    with pytest.raises(InvalidRequestError, match="at most one"):
        SamplingParams(structured_outputs={"json": SCHEMA, "regex": "a"})
