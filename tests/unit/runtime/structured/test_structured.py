"""kaon_runtime.structured without a model: specs, the compiled-grammar cache, masks, rollback, tool parsers.

The grammar tests use a hand-made byte tokenizer (one token per byte, a stop token after them)
and tiny grammars, so every allowed set can be written down.
"""
from __future__ import annotations

import json

import pytest
import torch

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.structured.compiler import GrammarCache
from kaon_runtime.structured.masks import allocate_bitmask, apply_bitmasks, apply_bitmasks_ref, unpack
from kaon_runtime.structured.matcher import SequenceGrammar
from kaon_runtime.structured.spec import GrammarSpec, spec_for
from kaon_runtime.structured.step_masks import MaskWorker, fill_step_masks
from kaon_runtime.structured.tool_grammar import MAX_PARALLEL_CALLS, forced_call_tag
from kaon_runtime.structured.tool_parsers import PartialCall, ToolCall, parser_for_template, parser_named
from kaon_runtime.structured.tool_prompt import prepare_messages

EOS = 256
VOCAB = 288  # padded past the tokenizer's 256 byte tokens and the stop token, as model vocabularies are
BYTES = Tokenizer.bytes_only(bos_token_id=None, eos_token_id=EOS)


@pytest.fixture(scope="module")
def tokenizer():
    return BYTES


@pytest.fixture(scope="module")
def cache(tokenizer):
    return GrammarCache(tokenizer, VOCAB, max_entries=3)


def ids(text: str) -> list[int]:
    return BYTES.encode(text)


def allowed(grammar: SequenceGrammar) -> set[int]:
    bitmask = allocate_bitmask(1, VOCAB)
    grammar.fill(bitmask, 0)
    return set(unpack(bitmask, VOCAB)[0].nonzero().flatten().tolist())


def test_the_mask_allows_exactly_what_the_grammar_does(cache):
    grammar = SequenceGrammar(cache.compile(GrammarSpec.grammar('root ::= "ab" | "ac"')))
    assert allowed(grammar) == set(ids("a"))
    assert grammar.accept(ids("a")[0])
    assert allowed(grammar) == set(ids("bc"))
    assert not grammar.accept(ids("x")[0]) and allowed(grammar) == set(ids("bc"))  # a refused token changes nothing
    assert grammar.accept(ids("c")[0])
    assert allowed(grammar) == {EOS}
    assert grammar.accept(EOS) and grammar.is_terminated


def test_rollback_returns_to_the_earlier_state(cache):
    grammar = SequenceGrammar(cache.compile(GrammarSpec.grammar('root ::= "ab" | "ac"')))
    for token in ids("ab"):
        assert grammar.accept(token)
    grammar.rollback(1)
    assert allowed(grammar) == set(ids("bc"))
    grammar.rollback(1)
    assert allowed(grammar) == set(ids("a"))


def test_masks_for_drafts_walk_forward_and_back(cache):
    grammar = SequenceGrammar(cache.compile(GrammarSpec.grammar('root ::= "abc" | "abd"')))
    bitmask = allocate_bitmask(4, VOCAB)
    grammar.masks_for_drafts(ids("ab"), bitmask, 1)  # rows 1, 2, 3: after the real tokens, after "a", after "ab"
    rows = unpack(bitmask, VOCAB)
    assert rows[0].all()  # not this sequence's row
    assert set(rows[1].nonzero().flatten().tolist()) == set(ids("a"))
    assert set(rows[2].nonzero().flatten().tolist()) == set(ids("b"))
    assert set(rows[3].nonzero().flatten().tolist()) == set(ids("cd"))
    assert allowed(grammar) == set(ids("a"))  # the walk was rolled back
    refused = allocate_bitmask(3, VOCAB)
    grammar.masks_for_drafts(ids("xa"), refused, 0)  # the first draft is refused: its row masks it out
    rows = unpack(refused, VOCAB)
    assert not rows[0][ids("x")[0]] and rows[1].all() and rows[2].all()
    assert allowed(grammar) == set(ids("a"))


def test_masked_rows_get_minus_infinity_and_other_rows_are_untouched(cache):
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    original = logits.clone()
    grammar = SequenceGrammar(cache.compile(GrammarSpec.choice(["yes", "no"])))
    bitmask = allocate_bitmask(3, VOCAB)
    grammar.fill(bitmask, 1)
    apply_bitmasks(logits, bitmask, [1])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    finite = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert set(finite) == set(ids("yn"))
    assert torch.equal(logits[1][finite], original[1][finite])
    assert int(logits[1].argmax()) in ids("yn")  # greedy now picks an allowed token


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_kernel_matches_the_torch_reference(dtype):
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB, dtype=dtype)
    bitmask = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, -(-VOCAB // 32)), dtype=torch.int32)
    rows = [0, 3, 4]
    assert torch.equal(apply_bitmasks(logits.clone(), bitmask, rows), apply_bitmasks_ref(logits.clone(), bitmask, rows))


def test_step_masks_lay_rows_out_like_the_runner(cache):
    grammar = SequenceGrammar(cache.compile(GrammarSpec.regex("[0-9]+")))
    assert fill_step_masks([(None, []), (None, [5, 6])], VOCAB) is None  # no grammar: no work at all
    masks = fill_step_masks([(None, [7]), (grammar, ids("1")), (None, [])], VOCAB)
    assert masks.rows == [2, 3]  # the unconstrained sequence's two rows come first
    assert masks.bitmask.shape[0] == 5
    worker = MaskWorker(VOCAB)
    try:
        assert worker.start([(None, [])]) is None
        future = worker.start([(grammar, [])])
        assert future.result().rows == [0]
    finally:
        worker.close()


def test_the_cache_compiles_each_spec_once_and_evicts_the_oldest(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, max_entries=2)
    specs = [GrammarSpec.regex(f"a{{{n}}}") for n in (1, 2, 3)]
    first = cache.compile(specs[0])
    assert cache.compile(GrammarSpec.regex("a{1}")) is first and (cache.hits, cache.misses) == (1, 1)
    cache.compile(specs[1])
    cache.compile(specs[2])
    assert len(cache) == 2 and cache.compile(specs[0]) is not first  # evicted, compiled again


@pytest.mark.parametrize(("spec", "words"), [
    (GrammarSpec.regex("(("), "regex"),
    (GrammarSpec.grammar("root ::= "), "EBNF grammar"),
    (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "JSON schema"),
])
def test_what_cannot_compile_is_an_invalid_request(cache, spec, words):
    with pytest.raises(InvalidRequestError, match=f"the {words} cannot be compiled: "):
        cache.compile(spec)


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "objekt"}, "schema.type: unknown type 'objekt'"),
    ({"type": "object", "properties": {"a": {"type": "integer", "minimum": 5, "maximum": 1}}},
     "schema.properties.a: minimum 5 is above maximum 1"),
    ({"type": "array", "items": 3}, "schema.items must be a JSON object"),
    ("{not json", "not valid JSON"),
])
def test_schema_mistakes_are_named(schema, problem):
    with pytest.raises(InvalidRequestError, match=problem.replace("(", r"\(")):
        GrammarSpec.json_schema(schema)


def test_sampling_params_take_one_constraint():
    assert spec_for(SamplingParams(regex="a+")) == GrammarSpec.regex("a+")
    assert spec_for(SamplingParams(json_schema={"type": "object"})) == GrammarSpec.json_schema('{"type":"object"}')
    assert spec_for(SamplingParams()) is None and not SamplingParams().constrained
    with pytest.raises(InvalidRequestError, match="at most one"):
        SamplingParams(regex="a", choice=["b"])


def test_grammars_whose_compile_grows_faster_than_their_bytes_are_refused_naming_the_limit():
    """One object's optional properties cost xgrammar about their cube: 2,500 of them fit in 64 KiB and held
    a compile thread for minutes. Required ones are cheap and not counted; a forced tool call's grammar is
    held to the byte limit like any other."""
    def optional(n: int, required: int = 0) -> dict:
        props = {f"p{i}": {"type": "string"} for i in range(n + required)}
        return {"type": "object", "properties": props, **({"required": [f"p{i}" for i in range(required)]}
                                                           if required else {})}
    spec_for(SamplingParams(json_schema=optional(256, required=1_500)))  # within the limits
    with pytest.raises(InvalidRequestError, match=r"257 optional properties, at most 256 .*grammar limit"):
        spec_for(SamplingParams(json_schema={"type": "array", "items": optional(257)}))
    with pytest.raises(InvalidRequestError, match="optional properties"):  # a tool's parameters, too
        forced_call_tag([{"name": "f", "parameters": optional(300)}], parser_named("hermes"), parallel=False)
    tag = forced_call_tag([{"name": "f", "parameters": optional(0, required=2_600)}], parser_named("hermes"),
                          parallel=False)
    with pytest.raises(InvalidRequestError, match=r"tool-call grammar .* at most 65536 \(the grammar limit"):
        spec_for(SamplingParams(structural_tag=tag))


# ---- tool calls ----------------------------------------------------------------------------

NAMES = {"get_weather", "noargs"}
WRITTEN = {
    "hermes": 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}\n'
              '</tool_call>\n<tool_call>\n{"name": "noargs", "arguments": {}}\n</tool_call>',
    "llama3": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "n": [1, {"x": "}"}]}}; '
              '{"name": "noargs", "parameters": {}}',
    "mistral": 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "n": [1, {"x": "}"}]}}, '
               '{"name": "noargs", "arguments": {}}]',
}
CALLS = [ToolCall("get_weather", '{"city": "Paris", "n": [1, {"x": "}"}]}'), ToolCall("noargs", "{}")]


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_parsers_read_calls_and_their_streams_add_up(name):
    parser = parser_named(name)
    text = WRITTEN[name]
    parsed = parser.parse(text, NAMES)
    assert parsed.calls == CALLS
    assert parsed.content == (None if name == "llama3" else "Sure.")
    # Streaming: what `partial` returns for each prefix only grows, and ends as `parse` does.
    sent: list[PartialCall] = []
    for end in range(1, len(text) + 1):
        content, calls = parser.partial(text[:end])
        assert (parsed.content or "").startswith(content.strip())
        for old, new in zip(sent, calls or []):
            assert old.name is None or old.name == new.name
            assert new.arguments.startswith(old.arguments)
        sent = calls or sent
    assert [(c.name, c.arguments) for c in sent] == [(c.name, c.arguments) for c in CALLS]
    assert parser.parse(parser.write(CALLS), NAMES).calls == CALLS


def test_text_that_is_not_a_call_stays_text():
    hermes = parser_named("hermes")
    for text in ["The weather is fine.", '<tool_call>\n{"name": "unknown", "arguments": {}}\n</tool_call>',
                 '<tool_call>\n{"name": "get_weather", "arguments": {"city": ']:
        assert hermes.parse(text, NAMES).calls == [] and hermes.parse(text, NAMES).content == text
    assert hermes.partial("Let me check <tool_")[0] == "Let me check"  # could be the marker: held back, and the space
    assert parser_named("llama3").parse('{"answer": 42}', NAMES).calls == []


def test_the_parser_follows_the_template():
    assert parser_for_template(None).name == "hermes"
    assert parser_for_template("{{ '<tool_call>' }}").name == "hermes"
    assert parser_for_template("{% if message.role == 'ipython' %}<|python_tag|>").name == "llama3"
    assert parser_for_template("[TOOL_CALLS]").name == "mistral"


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_a_forced_call_grammar_takes_only_calls_of_the_offered_functions(cache, name):
    parser = parser_named(name)
    functions = [{"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "n": {"type": "array"}}, "required": ["city"]}}, {"name": "noargs"}]

    def accepts(text: str, parallel: bool) -> bool:
        tag = forced_call_tag(functions, parser, parallel)
        grammar = SequenceGrammar(cache.compile(GrammarSpec.structural_tag(tag)))
        return all(grammar.accept(t) for t in ids(text) + [EOS])

    one = parser.write(CALLS[:1])
    assert accepts(one, parallel=False)
    assert accepts(parser.write(CALLS), parallel=True) and not accepts(parser.write(CALLS), parallel=False)
    assert not accepts(parser.write([ToolCall("other", "{}")]), parallel=True)
    assert not accepts(parser.write([ToolCall("get_weather", '{"n": []}')]), parallel=True)  # city is required
    assert not accepts("Sure. " + one, parallel=True)
    # Parallel calls are bounded, so a model that never chooses to stop still ends with whole calls.
    assert accepts(parser.write(CALLS[:1] * MAX_PARALLEL_CALLS), parallel=True)
    assert not accepts(parser.write(CALLS[:1] * (MAX_PARALLEL_CALLS + 1)), parallel=True)


def test_templates_without_tools_get_them_as_hermes_text():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18 C"}]
    plain = prepare_messages(history, tools, "{{ message['content'] }}", parser_named("hermes"))
    assert plain[0]["role"] == "system" and '"name": "get_weather"' in plain[0]["content"]
    assert plain[2] == {"role": "assistant",
                        "content": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'}
    assert plain[3] == {"role": "user", "content": "<tool_response>\n18 C\n</tool_response>"}
    aware = prepare_messages(history, tools, "{{ tools }}{{ message.tool_calls }}", parser_named("hermes"))
    assert aware[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert json.loads(history[1]["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris"}  # not modified
