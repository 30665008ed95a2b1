"""GET /kaon/tokenizer: the model's tokenizer as data (the tokenizers library's JSON, the chat
template, BOS/EOS), for the router's kv-aware strategy, which tokenizes a request as this engine
will to find the pod whose cache holds its prefix (router/kv_tokens.py in the operator).

Open like /health: the router holds no API key, and the tokenizer of a served model is no secret
(the NetworkPolicy admits only the router and the operator to the pods' port).
"""
from __future__ import annotations

import asyncio
import json

from fastapi import APIRouter, Request
from fastapi.responses import Response

routes = APIRouter()


@routes.get("/kaon/tokenizer", include_in_schema=False)
async def tokenizer_info(request: Request) -> Response:
    tokenizer = request.app.state.engine.tokenizer
    body = await asyncio.to_thread(_info, tokenizer)
    return Response(body, media_type="application/json")


def _info(tokenizer) -> bytes:
    return json.dumps({"tokenizer": tokenizer.backend.to_str(), "bos_token_id": tokenizer.bos_token_id,
                       "eos_token_ids": tokenizer.eos_token_ids, "chat_template": tokenizer.chat_template,
                       "add_bos": tokenizer.add_bos}).encode()
