"""`kaon serve --task embed` on a sentence encoder (engine/encoder.py): /v1/embeddings in OpenAI's wire format.

The same request model, validation, error shape, API-key check and response encoding as the
decoder's /v1/embeddings (server/embeddings.py, server/pipeline.py), in a small app of its own:
an encoder has no scheduler, KV cache or generation, so none of the decoder app's engine-bound
routes apply. Also /v1/models, /health and /ready (what the operator and the router probe).
With --enable-sleep-mode (the operator's standbys pass it to every engine) vLLM's sleep routes answer the admin
key as the decoder's do, but an encoder does not sleep: /is_sleeping is false, /sleep a 400 that says so (the
operator's StandbyFailed Event quotes it) and /wake_up has nothing to do.
"""
from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from kaon_runtime.engine.encoder import EncoderEngine
from kaon_runtime.server import embeddings
from kaon_runtime.server.keys import ApiKeys
from kaon_runtime.server.pipeline import APIError, install_error_handlers, parse, served_adapter
from kaon_runtime.server.sleep import admin_only


@dataclass
class EncoderSettings:
    model_name: str
    api_key: str | None = None
    api_key_file: str | None = None
    max_body_bytes: int = 16 * 1024 * 1024
    sleep_mode: bool = False
    admin_key: str | None = None


ENCODER_CANNOT_SLEEP = "sleep is not supported for a sentence encoder (it has no KV cache, and its weights are small)"


async def _authorized(request: Request) -> None:
    keys: ApiKeys = request.app.state.keys
    if not keys.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if not keys.accepts(token) or scheme.lower() != "bearer":
        raise APIError(401, "missing or invalid API key (send Authorization: Bearer <key>)", code="invalid_api_key")


def response_body(body: embeddings.EmbeddingRequest, model: str, results: list[tuple[list[float], int]]) -> dict:
    """OpenAI's embeddings list of the pooled vectors: L2-normalized unless the request sends vLLM's
    `normalize: false` (the default, normalized, is what a checkpoint with a Normalize module returns)."""
    data = [{"object": "embedding", "index": index,
             "embedding": embeddings.encode(vector, body.normalize, body.encoding_format, body.dimensions)}
            for index, (vector, _) in enumerate(results)]
    tokens = sum(count for _, count in results)
    return {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()), "model": model,
            "data": data, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def create_encoder_app(engine: EncoderEngine, settings: EncoderSettings) -> FastAPI:
    app = FastAPI(title="kaon (encoder)", docs_url=None, redoc_url=None)
    app.state.settings, app.state.engine = settings, engine
    app.state.keys = ApiKeys(settings.api_key, settings.api_key_file)
    install_error_handlers(app)
    authorized = [Depends(_authorized)]

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/ready")
    async def ready() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models", dependencies=authorized)
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": settings.model_name, "object": "model",
                                                         "created": 0, "owned_by": "kaon"}]})

    @app.post("/v1/embeddings", dependencies=authorized)
    async def create_embeddings(request: Request) -> Response:
        body = await parse(request, embeddings.EmbeddingRequest)
        served_adapter(body.model, settings.model_name, ())
        embeddings.check_dimensions(body.dimensions, engine.hidden_size, False)
        embeddings.kept(body.truncate_prompt_tokens, engine.sentence.max_seq_length)
        try:
            # Off the loop (/health stays live); raw pooled vectors, normalized by response_body.
            results = await asyncio.to_thread(engine.embed, body.prompts(), False, body.truncate_prompt_tokens)
        except ValueError as exc:  # an input past the model's maximum among them (engine/embed_input.py)
            raise APIError(400, str(exc), param="input", code=getattr(exc, "code", None)) from None
        return JSONResponse(response_body(body, settings.model_name, results))

    if settings.sleep_mode:
        admin = [Depends(admin_only)]

        @app.post("/sleep", dependencies=admin)
        async def sleep() -> Response:
            raise APIError(400, ENCODER_CANNOT_SLEEP, param="level", code="sleep_unsupported")

        @app.post("/wake_up", dependencies=admin)
        async def wake_up() -> Response:
            return Response(status_code=200)  # awake already, as vLLM answers

        @app.get("/is_sleeping", dependencies=admin)
        async def is_sleeping() -> JSONResponse:
            return JSONResponse({"is_sleeping": False})

    return app

