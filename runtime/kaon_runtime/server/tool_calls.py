"""Tool calling on the chat endpoint: from the request to the prompt and the grammar, from the text to tool_calls.

`plan_chat` decides what the model sees (the tools, in its template or, for a template that
knows none, as a Hermes-style system message) and what constrains it (response_format, or the
grammar of a forced call: tool_choice "required" or a named function). With tool_choice "auto"
nothing is forced: the model writes text or a call in its template's format, and the parser
turns what parses into tool_calls. `assistant_message` does that for a whole response,
`ToolCallStream` for a stream.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.server import protocol as p
from kaon_runtime.structured.tool_grammar import forced_call_tag
from kaon_runtime.structured.tool_parsers import PartialCall, ToolParser, parser_for_template, parser_named
from kaon_runtime.structured.tool_prompt import knows_tools, prepare_messages


@dataclass(slots=True)
class ToolCalling:
    """How a response's text is read for calls: the format, and the functions that were offered."""

    parser: ToolParser
    names: set[str]


@dataclass(slots=True)
class ChatPlan:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None  # for a template that renders them itself
    constraint: dict[str, Any]  # SamplingParams fields
    calling: ToolCalling | None  # None: no tools offered, the text is only text


def tool_parser(tokenizer: Tokenizer, name: str | None) -> ToolParser:
    """The parser named by --tool-call-parser, or the one the chat template's format calls for ("auto", None)."""
    return parser_for_template(tokenizer.chat_template) if name in (None, "auto") else parser_named(name)


def plan_chat(body: p.ChatCompletionRequest, tokenizer: Tokenizer, parser: ToolParser) -> ChatPlan:
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if body.tools_offered else None
    messages = prepare_messages([m.for_template() for m in body.messages], tools, tokenizer.chat_template, parser)
    constraint = body.output_constraint()
    if body.forces_tool_call:
        chosen = body.tool_choice.function.name if isinstance(body.tool_choice, p.NamedToolChoice) else None
        functions = [t.function.model_dump(exclude_none=True) for t in body.tools or []
                     if chosen is None or t.function.name == chosen]
        parallel = body.parallel_tool_calls is not False and chosen is None
        constraint = {"structural_tag": forced_call_tag(functions, parser, parallel)}
    calling = ToolCalling(parser, {t.function.name for t in body.tools or []}) if body.tools_offered else None
    return ChatPlan(messages, tools if knows_tools(tokenizer.chat_template) else None, constraint, calling)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assistant_message(text: str, finish_reason: str | None,
                      calling: ToolCalling | None) -> tuple[p.AssistantMessage, str | None]:
    """The message of a finished choice and its finish reason ("tool_calls" when it made calls)."""
    if calling is None:
        return p.AssistantMessage(content=text), finish_reason
    parsed = calling.parser.parse(text, calling.names, cut=finish_reason == "length")
    if not parsed.calls:
        return p.AssistantMessage(content=text), finish_reason
    calls = [p.ToolCallOut(id=new_call_id(), function=p.FunctionCall(name=c.name, arguments=c.arguments))
             for c in parsed.calls]
    return p.AssistantMessage(content=parsed.content, tool_calls=calls), _calls_finish(finish_reason)


def _calls_finish(reason: str | None) -> str | None:
    return "tool_calls" if reason == "stop" else reason


@dataclass(slots=True)
class ToolCallStream:
    """One streamed choice with tools offered: content until a call begins, then the calls as OpenAI
    streams them (index, id, type and name first, then argument fragments)."""

    calling: ToolCalling
    text: str = ""
    sent_content: int = 0
    sent: list[PartialCall] = field(default_factory=list)

    def update(self, delta: str, finished: bool) -> tuple[str, list[p.DeltaToolCall]]:
        """Add the new text; return the content and call deltas it makes safe to send."""
        self.text += delta
        content, calls = self.calling.parser.partial(self.text)
        if finished and not self.sent and not self.calling.parser.parse(self.text, self.calling.names, cut=True).calls:
            content, calls = self.text, None  # it never became a call: it is all text
        out_content = content[self.sent_content:] if len(content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(content))
        deltas = []
        for index, call in enumerate(calls or []):
            if call.name is None or call.name not in self.calling.names:
                break  # not sendable yet (or never): later calls wait for it
            if index == len(self.sent):
                self.sent.append(PartialCall(call.name, ""))
                deltas.append(p.DeltaToolCall(index=index, id=new_call_id(), type="function",
                                              function=p.DeltaFunction(name=call.name, arguments="")))
            fragment = call.arguments[len(self.sent[index].arguments):]
            if fragment:
                self.sent[index].arguments = call.arguments
                deltas.append(p.DeltaToolCall(index=index, function=p.DeltaFunction(arguments=fragment)))
        return out_content, deltas

    def finish_reason(self, reason: str | None) -> str | None:
        return _calls_finish(reason) if self.sent else reason
