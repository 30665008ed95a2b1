"""/v1/responses, the subset that maps onto a chat completion: `input` (text or messages),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`, `text.format`, and function
`tools`: the request becomes a chat completion's (function_call input items an assistant's
tool_calls, function_call_output items tool messages), so tool calling is the chat path's
(server/tool_calls.py), and its calls come back as function_call output items.

Stateless: nothing is stored, so `previous_response_id` and `store: true` are refused rather
than silently ignored (a client relying on them would lose its conversation).
"""
from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.errors import KaonError
from kaon_runtime.server import protocol as p
from kaon_runtime.server.serving import Generation
from kaon_runtime.server.tool_calls import ToolCalling, ToolCallStream, assistant_message


class InputText(p._Strict):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(p._Strict):
    model_config = ConfigDict(extra="ignore")  # "id", "status" of an earlier response's item
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class FunctionCallItem(p._Strict):
    """A call the model made earlier (an output item sent back as input)."""

    model_config = ConfigDict(extra="ignore")  # "id", "status"
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(p._Strict):
    """The result of a call, for the model to read."""

    model_config = ConfigDict(extra="ignore")  # "id", "status"
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class FunctionTool(p._Strict):
    """The Responses API's function tool: chat's function definition, flattened."""

    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_chat(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


class NamedFunction(p._Strict):
    type: Literal["function"]
    name: str


class TextFormat(p._Strict):
    """The Responses API's text.format: OpenAI's response_format with the schema's fields inline."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        return {"type": "json_schema", "json_schema": {
            "name": self.name or "output", "description": self.description, "schema": self.schema_,
            "strict": self.strict}}


class ResponseText(p._Strict):
    format: TextFormat | None = None


class ResponsesRequest(p._Strict):
    model_config = ConfigDict(extra="allow")  # unknown top-level fields: ignored, as on the other endpoints

    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: ResponseText | None = None  # text.format: free text, any JSON object, or JSON valid against a schema
    store: bool = False  # OpenAI's default is true; nothing is stored here, so only false is accepted
    previous_response_id: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None

    @model_validator(mode="after")
    def _stateless(self):
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported: this server stores no responses; "
                             "send the whole conversation in input")
        if self.store:
            raise ValueError("store: true is not supported: this server stores no responses")
        return self

    def as_chat(self) -> p.ChatCompletionRequest:
        """The same request as a chat completion."""
        messages = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += _chat_messages(self.input)
        fmt = self.text.format if self.text is not None else None
        choice = self.tool_choice
        return p.ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "response_format": fmt.response_format() if fmt is not None else None,
            "tools": [t.as_chat() for t in self.tools] if self.tools else None,
            "tool_choice": {"type": "function", "function": {"name": choice.name}}
            if isinstance(choice, NamedFunction) else choice,
            "parallel_tool_calls": self.parallel_tool_calls})


def _chat_messages(items: list[InputMessage | FunctionCallItem | FunctionCallOutputItem]) -> list[dict[str, Any]]:
    """Input items as chat messages: consecutive function_call items are one assistant message's
    tool_calls (as the model made them, in one turn), a function_call_output is a tool message."""
    messages: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") and not last["content"]:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(), "tool_call_id": item.call_id})
        else:
            messages.append({"role": item.role, "content": item.text()})
    return messages


class ResponsesFormat:
    """The response object, and a stream's events in OpenAI's order: response.created and .in_progress; the
    message item (output_item.added, content_part.added, output_text.delta..., output_text.done,
    content_part.done, output_item.done); with tools offered, each call the model made as a function_call
    item (output_item.added, function_call_arguments.delta and .done, output_item.done) once the text is
    complete; response.completed."""

    def __init__(self, gen: Generation, calling: ToolCalling | None = None):
        self.gen = gen
        self.calling = calling  # tools were offered: the text is read for calls
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self._final: list[dict[str, Any]] | None = None  # the finished output items, made once (ids stay)

    def response(self, output: RequestOutput | None) -> dict[str, Any]:
        done = output is not None and output.finished
        choice = output.outputs[0] if output is not None else None
        truncated = choice is not None and choice.finish_reason == "length"
        prompt = len(output.prompt_token_ids) if output is not None else 0
        generated = len(choice.token_ids) if choice is not None else 0
        return {
            "id": self.id, "object": "response", "created_at": self.created, "model": self.gen.model,
            "status": ("incomplete" if truncated else "completed") if done else "in_progress",
            "incomplete_details": {"reason": "max_output_tokens"} if done and truncated else None,
            "output": [] if choice is None else self._items(choice.text, choice.finish_reason),
            "usage": None if output is None else {
                "input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    def _items(self, text: str, finish_reason: str | None) -> list[dict[str, Any]]:
        """The output items: the message (unless the reply is only calls), then one per call."""
        if self._final is not None:
            return self._final
        status = "incomplete" if finish_reason == "length" else "completed"
        message, _ = assistant_message(text, finish_reason, self.calling)
        items: list[dict[str, Any]] = [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.id,
                  "name": call.function.name, "arguments": call.function.arguments, "status": "completed"}
                 for call in message.tool_calls or []]
        if message.content or not items:
            items.insert(0, {"type": "message", "id": self.item_id, "role": "assistant", "status": status,
                             "content": [{"type": "output_text", "text": message.content or "", "annotations": []}]})
        if finish_reason is not None:
            self._final = items
        return items

    async def events(self) -> AsyncIterator[str]:
        """OpenAI's event sequence, each with its sequence_number: the openai client's `responses.stream()`
        builds the response from them and needs each item and content part opened before its deltas."""
        number = itertools.count()

        def emit(kind: str, payload: dict[str, Any]) -> str:
            return _event(kind, {**payload, "sequence_number": next(number)})

        yield emit("response.created", {"response": self.response(None)})
        yield emit("response.in_progress", {"response": self.response(None)})
        calls = ToolCallStream(self.calling) if self.calling is not None else None
        sent, opened = 0, False
        try:
            async for output in self.gen.outputs():
                choice = output.outputs[0]
                delta = choice.text[sent:]
                sent = len(choice.text)
                if calls is not None:  # only the content: a call is sent whole once the text is complete
                    delta, _ = calls.update(delta, choice.finish_reason is not None)
                if delta:
                    if not opened:
                        opened = True
                        for kind, payload in self._message_opened():
                            yield emit(kind, payload)
                    yield emit("response.output_text.delta", {
                        "item_id": self.item_id, "output_index": 0, "content_index": 0, "delta": delta,
                        "logprobs": []})
        except KaonError as exc:  # the engine died under us: say so in-band
            yield emit("error", {"message": str(exc), "code": exc.code, "param": None})
            return
        final = self.response(self.gen.last)
        for index, item in enumerate(final["output"]):
            if item["type"] == "message":
                if not opened:  # an empty reply is still a message, opened and closed
                    for kind, payload in self._message_opened():
                        yield emit(kind, payload)
                for kind, payload in _message_closed(item, index):
                    yield emit(kind, payload)
            else:
                for kind, payload in call_events(item, index):
                    yield emit(kind, payload)
        yield emit("response.completed", {"response": final})

    def _message_opened(self) -> list[tuple[str, dict[str, Any]]]:
        item = {"type": "message", "id": self.item_id, "role": "assistant", "status": "in_progress", "content": []}
        return [("response.output_item.added", {"output_index": 0, "item": item}),
                ("response.content_part.added", {"item_id": self.item_id, "output_index": 0, "content_index": 0,
                                                 "part": {"type": "output_text", "text": "", "annotations": []}})]


def _message_closed(item: dict[str, Any], index: int) -> list[tuple[str, dict[str, Any]]]:
    part = item["content"][0]
    where = {"item_id": item["id"], "output_index": index, "content_index": 0}
    return [("response.output_text.done", {**where, "text": part["text"], "logprobs": []}),
            ("response.content_part.done", {**where, "part": part}),
            ("response.output_item.done", {"output_index": index, "item": item})]


def call_events(item: dict[str, Any], index: int) -> list[tuple[str, dict[str, Any]]]:
    """A finished call as the Responses API streams one: added, its arguments, done."""
    added = {**item, "arguments": "", "status": "in_progress"}
    return [("response.output_item.added", {"output_index": index, "item": added}),
            ("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": index,
                                                        "delta": item["arguments"]}),
            ("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                       "arguments": item["arguments"]}),
            ("response.output_item.done", {"output_index": index, "item": item})]


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"
