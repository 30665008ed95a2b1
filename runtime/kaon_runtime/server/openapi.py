"""The server's OpenAPI document (/openapi.json): what each route takes and answers.

Every route reads and validates its body itself (server/pipeline.py: the size limit first, then
strict validation with OpenAI-shaped 400s), so FastAPI does not know the request models.
They are declared here for the document only, and narrowed to what this server accepts: the
one model it serves, its context length, its vocabulary. Every error is an ErrorResponse.
"""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from kaon_runtime.server import protocol as p
from kaon_runtime.server.embeddings import EmbeddingRequest
from kaon_runtime.server.responses import ResponsesRequest

API_VERSION = "1"
GENERATE_MODELS = (p.CompletionRequest, p.ChatCompletionRequest, ResponsesRequest)
NAMED_MODELS = (*GENERATE_MODELS, EmbeddingRequest)  # `model` must be the served name
REQUEST_MODELS = (*NAMED_MODELS, p.TokenizeRequest, p.DetokenizeRequest, p.LoadLoraAdapterRequest,
                  p.UnloadLoraAdapterRequest)

Responses = dict[int | str, dict[str, Any]]  # a route's `responses=`, as FastAPI types it

_ERROR = {"model": p.ErrorResponse}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying", "schema": {"type": "integer"}}}
_STATUS_OK = {"description": "Ready", "content": {"application/json": {"schema": {
    "type": "object", "properties": {"status": {"type": "string", "const": "ok"}}, "required": ["status"]}}}}
# One server-sent event, as OpenAPI before 3.2 describes them: `data` is a JSON chunk (the
# response object with the new text), an in-band error object, or the final `[DONE]`.
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}

HEALTH: Responses = {200: _STATUS_OK, 503: {**_ERROR, "description": "The engine is dead (or, for /ready, draining)"}}
METRICS: Responses = {200: {"description": "Prometheus text format 0.0.4",
                            "content": {"text/plain": {"schema": {"type": "string"}}}}}
V1_ERRORS: Responses = {401: {**_ERROR, "description": "Missing or wrong API key"},
                        503: {**_ERROR, "headers": _RETRY_AFTER, "description": "Draining, or the engine is dead"}}
GENERATE: Responses = {
    200: {"description": "The whole response; with `stream: true`, server-sent events ending with `data: [DONE]`",
          "content": {"text/event-stream": {"schema": _SSE_EVENT}}},
    400: {**_ERROR, "description": "Invalid request (bad JSON, wrong type, unknown or unsupported field, too long)"},
    404: {**_ERROR, "description": "Unknown model"},
    413: {**_ERROR, "description": "Body larger than --max-body-bytes"},
    429: {**_ERROR, "headers": _RETRY_AFTER, "description": "Queue full (--max-queue)"},
    **V1_ERRORS,
}


def json_body(model: type[BaseModel]) -> dict:
    """An operation's `openapi_extra` declaring `model` as its JSON body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def install(app: FastAPI, model_name: str, max_model_len: int, vocab_size: int, secured: bool) -> None:
    """Make `app.openapi()` include the request models (and the bearer scheme when a key is set)."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = _build(app, model_name, max_model_len, vocab_size, secured)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to extend the document


def _build(app: FastAPI, model_name: str, max_model_len: int, vocab_size: int, secured: bool) -> dict:
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    _, defs = models_json_schema([(m, "validation") for m in REQUEST_MODELS],
                                 ref_template="#/components/schemas/{model}")
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    schemas.update(defs["$defs"])
    for model in NAMED_MODELS:
        props = schemas[model.__name__]["properties"]
        props["model"] = {**props["model"], "enum": [model_name]}
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if name in props:  # at least one token must fit after the prompt
                _integers(props[name], maximum=max_model_len - 1)
    _integers(schemas[p.CompletionRequest.__name__]["properties"]["prompt"], maximum=vocab_size - 1)
    if secured:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for path, operations in schema["paths"].items():
            if path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
                for operation in operations.values():
                    operation["security"] = [{"bearer": []}]
    return schema


def _integers(schema: dict[str, Any], maximum: int) -> None:
    """Bound every integer in `schema` (token ids in a prompt, a token count) from above."""
    if schema.get("type") == "integer":
        schema["maximum"] = maximum
    for key in ("anyOf", "oneOf"):
        for variant in schema.get(key, ()):
            _integers(variant, maximum)
    if isinstance(schema.get("items"), dict):
        _integers(schema["items"], maximum)
