"""Loading and unloading LoRA adapters at run time, as vLLM exposes it: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter with {"lora_name", "lora_path"}; the app guards them with the API key.
A lora_path may be hf:// or s3:// (downloaded into the model cache first, as the model was), which
is how the operator loads the adapters of spec.adapters.

An adapter that does not fit the model (another base, target modules the engine cannot serve, a
rank over --max-lora-rank) is refused at load with the reason (400); unloading an unknown name
is a 404. The replies are vLLM's plain-text ones.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.server import openapi as doc, protocol as p
from kaon_runtime.server.pipeline import parse

RESPONSES: doc.Responses = {
    200: {"description": "vLLM's plain-text confirmation", "content": {"text/plain": {"schema": {"type": "string"}}}},
    400: {"model": p.ErrorResponse, "description": "The adapter cannot be loaded (the reason), or a bad body"},
    404: {"model": p.ErrorResponse, "description": "No adapter of that name is loaded"},
    413: {"model": p.ErrorResponse, "description": "Body larger than --max-body-bytes"},
    **doc.V1_ERRORS}

routes = APIRouter()


# The replies are plain text, the errors JSON: the route returns its PlainTextResponse itself, so the
# document keeps the errors' application/json (a response_class would label them text/plain too).
@routes.post("/v1/load_lora_adapter", response_model=None, responses=RESPONSES,
             openapi_extra=doc.json_body(p.LoadLoraAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse(request, p.LoadLoraAdapterRequest)
    if body.lora_name == request.app.state.settings.model_name:
        raise InvalidRequestError(f"{body.lora_name!r} is the base model's name")
    path = source = body.lora_path
    if path.startswith(("hf://", "s3://")):
        fetch_adapter = request.app.state.settings.fetch_adapter
        if fetch_adapter is None:
            raise InvalidRequestError(f"{path}: this server downloads no adapters; give a local directory")
        path = await asyncio.to_thread(fetch_adapter, path)  # a download: off the event loop
    # Listed with the URI it was asked for as its root (as vLLM lists lora_path): the operator compares
    # it with spec.adapters, and a cache directory there would look like another adapter every round.
    await request.app.state.engine.add_lora(body.lora_name, path, source)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@routes.post("/v1/unload_lora_adapter", response_model=None, responses=RESPONSES,
             openapi_extra=doc.json_body(p.UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse(request, p.UnloadLoraAdapterRequest)
    request.app.state.engine.remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
