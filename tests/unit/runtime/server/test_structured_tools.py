"""Tool calls read out of text as a whole response and as a stream, without a model.

Streams are checked the way a client sees them: the chunks go through the openai client's own
streaming helper (ChatCompletionStreamState), which reassembles delta.tool_calls by index.
"""
from __future__ import annotations

import json

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from kaon_runtime.server import protocol as p
from kaon_runtime.server.tool_calls import ToolCalling, ToolCallStream, assistant_message
from kaon_runtime.structured.tool_parsers import parser_named

NAMES = {"get_weather", "get_time"}
WEATHER_ARGS = '{"city": "Lyon", "unit": "celsius"}'

# One call written in the orders a model may choose; {a} is the arguments key of the format.
ORDERS = {
    "name first": '{"name": "get_weather", "{a}": ' + WEATHER_ARGS + "}",
    "arguments first": '{"{a}": ' + WEATHER_ARGS + ', "name": "get_weather"}',
    "another key between": '{"name": "get_weather", "id": 7, "{a}": ' + WEATHER_ARGS + "}",
    "spaced": '{ "name" : "get_weather" ,\n  "{a}" :' + WEATHER_ARGS + " }",
}
WRAP = {  # two calls (the second to get_time) in each format
    "hermes": ("Let me look.\n<tool_call>\n{one}\n</tool_call>\n<tool_call>\n{two}\n</tool_call>", "arguments"),
    "llama3": ("<|python_tag|>{one}; {two}", "parameters"),
    "mistral": ("Let me look.[TOOL_CALLS][{one}, {two}]", "arguments"),
}
TIME_CALL = '{"{a}": {"city": "Nice"}, "name": "get_time"}'


def written(parser: str, order: str) -> str:
    template, key = WRAP[parser]
    return template.format(one=ORDERS[order].replace("{a}", key), two=TIME_CALL.replace("{a}", key))


def stream(text: str, parser: str, pieces: int, finish: str = "stop"):
    """The chunks a stream of `text` in pieces of `pieces` characters sends, as openai's models."""
    calls = ToolCallStream(ToolCalling(parser_named(parser), NAMES))
    chunks = []
    for start in range(0, len(text), pieces):
        last = start + pieces >= len(text)
        content, deltas = calls.update(text[start:start + pieces], last)
        delta = p.DeltaMessage(role="assistant" if start == 0 else None, content=content or None,
                               tool_calls=deltas or None)
        reason = calls.finish_reason(finish) if last else None
        chunks.append(ChatCompletionChunk.model_validate({
            "id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta.model_dump(), "finish_reason": reason}]}))
    return chunks


@pytest.mark.parametrize("order", sorted(ORDERS))
@pytest.mark.parametrize("parser", sorted(WRAP))
@pytest.mark.parametrize("pieces", [1, 5])
def test_streamed_calls_reassemble_to_the_whole_response_in_any_key_order(parser, order, pieces):
    text = written(parser, order)
    whole, finish = assistant_message(text, "stop", ToolCalling(parser_named(parser), NAMES))
    assert finish == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "Lyon", "unit": "celsius"}), ("get_time", {"city": "Nice"})]
    chunks = stream(text, parser, pieces)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(chunk)
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and (final.message.content or None) == whole.content
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.tool_calls]
    # OpenAI's shape: a call's first delta names it (index, id, type, name, arguments ""), the rest add arguments.
    deltas = [d for chunk in chunks for d in chunk.choices[0].delta.tool_calls or []]
    seen = set()
    for d in deltas:
        if d.index not in seen:
            seen.add(d.index)
            assert d.id and d.type == "function" and d.function.name and d.function.arguments == ""
        else:
            assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
    if order != "arguments first" and pieces == 1:  # the name came first: the arguments stream as written
        assert sum(d.index == 0 and bool(d.function.arguments) for d in deltas) > 1


@pytest.mark.parametrize("parser", sorted(WRAP))
def test_calls_cut_at_max_tokens_keep_the_whole_ones_and_finish_with_length(parser):
    text = written(parser, "name first")
    cut = text[:text.index("Nice")]  # inside the second call
    calling = ToolCalling(parser_named(parser), NAMES)
    message, finish = assistant_message(cut, "length", calling)
    assert finish == "length"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", WEATHER_ARGS)]
    assert message.content == (None if parser == "llama3" else "Let me look.")
    # The same text said to have stopped is not a call: it stays text, as a model's malformed call does.
    assert assistant_message(cut, "stop", calling) == (p.AssistantMessage(content=cut), "stop")
    state = ChatCompletionStreamState()
    for chunk in stream(cut, parser, 3, finish="length"):
        state.handle_chunk(chunk)
    final = state.current_completion_snapshot.choices[0]  # get_final_completion raises on "length"
    assert final.finish_reason == "length" and final.message.tool_calls[0].function.arguments == WEATHER_ARGS
