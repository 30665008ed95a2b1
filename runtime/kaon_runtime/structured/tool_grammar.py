"""Grammars that force tool calls: tool_choice "required" or a named function, in a parser's format.

The grammar is an xgrammar structural tag: one tag per offered function, whose begin string
writes the call's head (`<tool_call>\n{"name": "get_weather", "arguments": ` in Hermes' format),
whose content is the function's parameters schema, and whose end closes the call. Calls are
joined by the format's separator: one call when parallel_tool_calls is false, else one to
MAX_PARALLEL_CALLS. After each whole call the model may end (EOS is allowed there), but a small
model often writes the separator instead and goes on calling until max_tokens; the bound makes
the grammar itself end the reply, so a forced reply always finishes with whole calls. Even a
small model then writes a call that parses, to a function that exists, with arguments valid
against its schema. Whitespace inside the arguments comes one character at a time at most: a
small model left free to indent can indent until max_tokens.
"""
from __future__ import annotations

import json

from kaon_runtime.structured.spec import check_schema
from kaon_runtime.structured.tool_parsers import ToolParser

EMPTY_PARAMETERS = {"type": "object", "properties": {}}

# Calls in one forced reply. An agent loop asks again for what did not fit; unbounded, a small
# model that never chooses to stop fills max_tokens and its last call is cut.
MAX_PARALLEL_CALLS = 4

# Per format: call head (with {name} to fill), call tail, separator between calls, and text around all calls.
_FORMATS = {
    "hermes": ('<tool_call>\n{{"name": {name}, "arguments": ', "}\n</tool_call>", "\n", "", ""),
    "llama3": ('{{"name": {name}, "parameters": ', "}", "; ", "", ""),
    "mistral": ('{{"name": {name}, "arguments": ', "}", ", ", "[TOOL_CALLS][", "]"),
}


def forced_call_tag(functions: list[dict], parser: ToolParser, parallel: bool,
                    max_calls: int = MAX_PARALLEL_CALLS) -> dict:
    """The structural tag (SamplingParams.structural_tag) of one call, or when `parallel` one to
    `max_calls` calls, each to one of `functions` (OpenAI's function objects: name, description, parameters)."""
    head, tail, separator, opening, closing = _FORMATS[parser.name]
    tags: list[dict] = []
    for function in functions:
        parameters = function.get("parameters") or EMPTY_PARAMETERS
        check_schema(parameters, f"tools[{function['name']}].function.parameters")
        tags.append({"type": "tag", "begin": head.format(name=json.dumps(function["name"])),
                     "content": {"type": "json_schema", "json_schema": parameters, "max_whitespace_cnt": 1},
                     "end": tail})
    call: dict = tags[0] if len(tags) == 1 else {"type": "or", "elements": tags}
    calls: dict = call
    if parallel and max_calls > 1:
        more = {"type": "sequence", "elements": [{"type": "const_string", "value": separator}, call]}
        calls = {"type": "sequence", "elements": [call, {"type": "repeat", "min": 0, "max": max_calls - 1,
                                                          "content": more}]}
    if opening or closing:
        calls = {"type": "sequence", "elements": [{"type": "const_string", "value": opening}, calls,
                                                  {"type": "const_string", "value": closing}]}
    return {"type": "structural_tag", "format": calls}
