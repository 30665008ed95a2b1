"""/tokenize and /detokenize, as vLLM exposes them: what the model's tokenizer makes of a prompt
(a text, or chat messages through the chat template, exactly as /v1/chat/completions renders them).

Tokenizing costs what it costs for generation, so these go through the same admission (issue 48):
a prompt over --max-prompt-bytes is a 400 before it is tokenized, a full queue a 429, and the
work (template, encoding, token strings, the JSON of the reply) runs off the event loop, so a
large reply does not hold /health.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.server import openapi as doc, protocol as p
from kaon_runtime.server.limits import check_prompt, utf8_length
from kaon_runtime.server.pipeline import check_model, parse

RESPONSES: doc.Responses = {
    400: {"model": p.ErrorResponse, "description": "Invalid request (bad JSON, wrong type, unknown field)"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    413: {"model": p.ErrorResponse, "description": "Body larger than --max-body-bytes"},
    **doc.V1_ERRORS}


routes = APIRouter()


@routes.post("/tokenize", response_model=p.TokenizeResponse, openapi_extra=doc.json_body(p.TokenizeRequest),
              responses=RESPONSES)
async def tokenize(request: Request) -> Response:
    body = await parse(request, p.TokenizeRequest)
    check_model(request, body.model)  # an adapter's name too: adapters share the base model's tokenizer
    engine = request.app.state.engine
    size = sum(utf8_length(m.text()) for m in body.messages) if body.messages else utf8_length(body.prompt or "")
    check_prompt(size, 0, request.app.state.settings.limits, engine.max_model_len)
    with request.app.state.admission.slot():
        reply = await asyncio.to_thread(_tokenized, engine.tokenizer, body, engine.max_model_len)
    return Response(reply, media_type="application/json")


def _tokenized(tokenizer, body: p.TokenizeRequest, max_model_len: int) -> bytes:
    """The reply's JSON, on a worker thread."""
    if body.messages is not None:
        text = tokenizer.apply_chat_template([m.for_template() for m in body.messages], body.add_generation_prompt)
    else:
        text = body.prompt or ""
    ids = tokenizer.encode(text) if text else []
    strs = [tokenizer.token_to_str(t) for t in ids] if body.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=max_model_len, tokens=ids,
                              token_strs=strs).model_dump_json().encode()


@routes.post("/detokenize", response_model=p.DetokenizeResponse, openapi_extra=doc.json_body(p.DetokenizeRequest),
              responses=RESPONSES)
async def detokenize(request: Request) -> p.DetokenizeResponse:
    body = await parse(request, p.DetokenizeRequest)
    check_model(request, body.model)
    engine = request.app.state.engine
    check_prompt(0, len(body.tokens), request.app.state.settings.limits, engine.max_model_len)
    if not all(0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be token ids in [0, {engine.vocab_size})")
    with request.app.state.admission.slot():
        return p.DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, body.tokens))
