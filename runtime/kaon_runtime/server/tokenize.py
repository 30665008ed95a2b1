"""/tokenize and /detokenize, as vLLM exposes them: what the model's tokenizer makes of a prompt
(a text, or chat messages through the chat template, exactly as /v1/chat/completions renders them)."""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.server import openapi as doc, protocol as p
from kaon_runtime.server.pipeline import check_model, parse

RESPONSES: doc.Responses = {
    400: {"model": p.ErrorResponse, "description": "Invalid request (bad JSON, wrong type, unknown field)"},
    404: {"model": p.ErrorResponse, "description": "Unknown model"},
    413: {"model": p.ErrorResponse, "description": "Body larger than --max-body-bytes"},
    **doc.V1_ERRORS}


routes = APIRouter()


@routes.post("/tokenize", response_model=p.TokenizeResponse, openapi_extra=doc.json_body(p.TokenizeRequest),
              responses=RESPONSES)
async def tokenize(request: Request) -> p.TokenizeResponse:
    body = await parse(request, p.TokenizeRequest)
    check_model(request, body.model)  # an adapter's name too: adapters share the base model's tokenizer
    engine = request.app.state.engine
    tokenizer = engine.tokenizer
    if body.messages is not None:
        messages = [m.for_template() for m in body.messages]
        text = await asyncio.to_thread(tokenizer.apply_chat_template, messages, body.add_generation_prompt)
    else:
        text = body.prompt or ""
    ids = await asyncio.to_thread(tokenizer.encode, text) if text else []
    strs = [tokenizer.token_to_str(t) for t in ids] if body.return_token_strs else None
    return p.TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)


@routes.post("/detokenize", response_model=p.DetokenizeResponse, openapi_extra=doc.json_body(p.DetokenizeRequest),
              responses=RESPONSES)
async def detokenize(request: Request) -> p.DetokenizeResponse:
    body = await parse(request, p.DetokenizeRequest)
    check_model(request, body.model)
    engine = request.app.state.engine
    if not all(0 <= t < engine.vocab_size for t in body.tokens):
        raise InvalidRequestError(f"tokens must be token ids in [0, {engine.vocab_size})")
    return p.DetokenizeResponse(prompt=await asyncio.to_thread(engine.tokenizer.decode, body.tokens))
