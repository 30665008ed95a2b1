"""/v1/responses, the subset that maps onto a chat completion: `input` (text or messages),
`instructions`, `max_output_tokens`, `temperature`, `top_p`, `stream`.

Stateless: nothing is stored, so `previous_response_id` and `store: true` are refused rather
than silently ignored (a client relying on them would lose its conversation).
"""
from __future__ import annotations

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
    input: str | list[InputMessage] = Field(min_length=1)
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: ResponseText | None = None  # text.format: free text, any JSON object, or JSON valid against a schema
    store: bool = False  # OpenAI's default is true; nothing is stored here, so only false is accepted
    previous_response_id: str | None = None
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
            messages += [{"role": m.role, "content": m.text()} for m in self.input]
        fmt = self.text.format if self.text is not None else None
        return p.ChatCompletionRequest.model_validate({
            "model": self.model, "messages": messages, "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p,
            "response_format": fmt.response_format() if fmt is not None else None})


class ResponsesFormat:
    """The response object, and a stream's events (response.created, response.output_text.delta,
    response.completed)."""

    def __init__(self, gen: Generation):
        self.gen = gen
        self.id = f"resp_{uuid.uuid4().hex}"
        self.item_id = f"msg_{uuid.uuid4().hex}"
        self.created = int(time.time())

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
            "output": [] if choice is None else [{
                "type": "message", "id": self.item_id, "role": "assistant",
                "status": "incomplete" if truncated else "completed",
                "content": [{"type": "output_text", "text": choice.text, "annotations": []}]}],
            "usage": None if output is None else {
                "input_tokens": prompt, "output_tokens": generated, "total_tokens": prompt + generated,
                "input_tokens_details": {"cached_tokens": output.num_cached_tokens},
                "output_tokens_details": {"reasoning_tokens": 0}},
        }

    async def events(self) -> AsyncIterator[str]:
        yield _event("response.created", {"response": self.response(None)})
        sent = 0
        try:
            async for output in self.gen.outputs():
                text = output.outputs[0].text
                if len(text) > sent:
                    yield _event("response.output_text.delta", {
                        "item_id": self.item_id, "output_index": 0, "content_index": 0, "delta": text[sent:]})
                    sent = len(text)
        except KaonError as exc:  # the engine died under us: say so in-band
            yield _event("error", {"message": str(exc)})
            return
        last = self.gen.last
        yield _event("response.completed", {"response": self.response(last)})


def _event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **payload})}\n\n"
