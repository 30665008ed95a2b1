"""Loading and unloading LoRA adapters at run time, as vLLM exposes it: POST /v1/load_lora_adapter and
/v1/unload_lora_adapter with {"lora_name", "lora_path"}. A lora_path may be hf:// or s3://
(downloaded into the model cache first, as the model was), which is how the operator loads the
adapters of spec.adapters.

Changing the adapters administers the engine, so it is no client's business (as vLLM keeps it
behind VLLM_ALLOW_RUNTIME_LORA_UPDATING): off (404, as a route that does not exist) unless
`kaon serve --enable-runtime-lora`, and then only with the admin key (--admin-key, $KAON_ADMIN_KEY),
which the serving keys are not: the operator holds it, clients do not. A load is checked (the
key, the name, the count of registered adapters) before anything is downloaded; one load runs at
a time, within --lora-load-timeout, and an adapter directory over --max-lora-bytes is refused
before it is read, so registrations cannot grow the engine's memory past count x bytes.

An adapter that does not fit the model (another base, target modules the engine cannot serve, a
rank over --max-lora-rank) is refused at load with the reason (400); unloading an unknown name
is a 404. The replies are vLLM's plain-text ones.
"""
from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.server import openapi as doc, protocol as p
from kaon_runtime.server.keys import matches
from kaon_runtime.server.pipeline import APIError, parse

logger = logging.getLogger("kaon.server")

RESPONSES: doc.Responses = {
    200: {"description": "vLLM's plain-text confirmation", "content": {"text/plain": {"schema": {"type": "string"}}}},
    400: {"model": p.ErrorResponse, "description": "The adapter cannot be loaded (the reason), or a bad body"},
    404: {"model": p.ErrorResponse, "description": "No adapter of that name is loaded"},
    413: {"model": p.ErrorResponse, "description": "Body larger than --max-body-bytes"},
    **doc.V1_ERRORS}


def admin_allowed(enabled: bool, admin_key: str | None, authorization: str) -> int | None:
    """None when `authorization` (the header) may change the adapters, else the status to refuse with:
    404 while runtime changes are off (or no admin key is set: off, never open), 401 without the admin key."""
    if not enabled or not admin_key:
        return 404
    scheme, _, token = authorization.partition(" ")
    ok = matches(token.encode(), (admin_key.encode(),))  # compared first: the same time either way
    return None if ok and scheme.lower() == "bearer" else 401


async def _admin(request: Request) -> None:
    settings = request.app.state.settings
    refused = admin_allowed(settings.runtime_lora, settings.admin_key, request.headers.get("authorization", ""))
    if refused == 404:
        raise APIError(404, f"no route {request.url.path}: runtime adapter changes are off", code="not_found")
    if refused is not None:
        raise APIError(401, "changing adapters needs the admin key (Authorization: Bearer <admin key>)",
                       code="invalid_api_key")


def directory_bytes(path: str) -> int:
    """What reading an adapter directory (or file) costs at most: its files' sizes."""
    root = Path(path)
    if root.is_file():
        return root.stat().st_size
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file()) if root.is_dir() else 0


routes = APIRouter(dependencies=[Depends(_admin)])


# The replies are plain text, the errors JSON: the route returns its PlainTextResponse itself, so the
# document keeps the errors' application/json (a response_class would label them text/plain too).
@routes.post("/v1/load_lora_adapter", response_model=None, responses=RESPONSES,
             openapi_extra=doc.json_body(p.LoadLoraAdapterRequest))
async def load_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse(request, p.LoadLoraAdapterRequest)
    settings, engine = request.app.state.settings, request.app.state.engine
    if body.lora_name == settings.model_name:
        raise InvalidRequestError(f"{body.lora_name!r} is the base model's name")
    # One load at a time (later ones queue on the lock, not as threads that each hold a download). A load
    # past the timeout is answered 400 but runs on, holding the lock: a thread cannot be stopped, and
    # a load that finishes late is listed in /v1/models, where the operator looks next.
    load = asyncio.ensure_future(_locked_load(request.app.state.lora_lock, engine, settings, body.lora_name,
                                              body.lora_path))
    try:
        await asyncio.wait_for(asyncio.shield(load), settings.lora_load_timeout)
    except TimeoutError:
        raise APIError(400, f"adapter {body.lora_path}: not loaded within --lora-load-timeout "
                       f"({settings.lora_load_timeout:g} s)", code="load_timeout") from None
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


async def _locked_load(lock: asyncio.Lock, engine, settings, name: str, source: str) -> None:
    async with lock:
        await _load(engine, settings, name, source)


async def _load(engine, settings, name: str, source: str) -> None:
    held = engine.lora_adapters()
    if name in {n for n, _ in held}:
        raise InvalidRequestError(f"the LoRA adapter {name!r} is already loaded")
    if len(held) >= settings.max_registered_loras:  # before any download
        raise InvalidRequestError(f"{len(held)} adapters are registered, the most --max-cpu-loras allows; "
                                  "unload one first")
    path = source
    if path.startswith(("hf://", "s3://")):
        if settings.fetch_adapter is None:
            raise InvalidRequestError(f"{path}: this server downloads no adapters; give a local directory")
        path = await asyncio.to_thread(settings.fetch_adapter, path)  # a download: off the event loop
    size = await asyncio.to_thread(directory_bytes, path)
    if size > settings.max_lora_bytes:
        raise InvalidRequestError(f"adapter {source}: {size} bytes, over --max-lora-bytes ({settings.max_lora_bytes})")
    # Listed with the URI it was asked for as its root (as vLLM lists lora_path): the operator compares
    # it with spec.adapters, and a cache directory there would look like another adapter every round.
    await engine.add_lora(name, path, source)


@routes.post("/v1/unload_lora_adapter", response_model=None, responses=RESPONSES,
             openapi_extra=doc.json_body(p.UnloadLoraAdapterRequest))
async def unload_lora_adapter(request: Request) -> PlainTextResponse:
    body = await parse(request, p.UnloadLoraAdapterRequest)
    request.app.state.engine.remove_lora(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
