"""One request pipeline for every route: the body read within --max-body-bytes and validated into
its protocol model, the model it names checked, and every failure shaped as OpenAI's error.

Each route calls `parse` and `check_model` (the generating routes, the embeddings, /tokenize and
/detokenize, the LoRA routes alike), so a request gets the same answer whichever route it reaches:
a body past the limit is a 413 `request_too_large`, one that does not validate a 400 naming the
field, a model this server does not serve a 404 `model_not_found` (OpenAI's answer, and vLLM's).
The error handlers turn the engine's exceptions into the same body,
`{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from kaon_runtime.errors import (
    EngineDeadError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    QueueFullError,
)
from kaon_runtime.server import protocol as p

RETRY_AFTER_S = 1  # a full queue drains in seconds; tell well-behaved clients to come back soon
CLIENT_CLOSED_REQUEST = 499  # nginx's code for a client gone before the response; only the access log sees it

Body = TypeVar("Body", bound=BaseModel)
logger = logging.getLogger("kaon.server")


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def response(self) -> JSONResponse:
        body = p.ErrorResponse(error=p.ErrorInfo(message=self.message, type=self.type, param=self.param,
                                                 code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status, headers=self.headers)


# ---- the body --------------------------------------------------------------------------------


async def parse(request: Request, model: type[Body]) -> Body:
    """Read the body within the size limit and validate it strictly; every failure is a 400 or 413.

    Read here rather than by FastAPI, which reads any length and then answers 422."""
    limit = request.app.state.settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large(limit)
    try:
        return model.model_validate_json(bytes(body))
    except ValidationError as exc:
        raise bad_input(exc.errors()) from None


def too_large(limit: int) -> APIError:
    return APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")


# pydantic names the arm of a union it tried in an error's location ("stop.str", "prompt.list[int]",
# "messages.0.content.list[TextPart]"); the client's field is the path without it.
_UNION_ARM = re.compile(r"str|int|float|bool|none|(list|dict|tuple|literal|function-\w+)\[.*\]|[A-Z]\w*")


def bad_input(errors) -> APIError:
    """A validation failure as a 400 naming the first bad field (`param`, and in the message)."""
    first = errors[0]
    param = ".".join(str(part) for part in first["loc"] if not _UNION_ARM.fullmatch(str(part))) or None
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "json_invalid":
        message = f"the body is not valid JSON: {message}"
    elif param is not None:
        message = f"{param}: {message}"
    return APIError(400, message, param=param)


# ---- the model it names -----------------------------------------------------------------------


def check_model(request: Request, name: str | None, adapters: bool = True) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model, or no name where the field
    is optional); a 404 for anything else. `adapters` False: this route serves the base model only."""
    served = request.app.state.settings.model_name
    loaded = (adapter for adapter, _ in request.app.state.engine.lora_adapters()) if adapters else ()
    return served_adapter(name, served, loaded)


def served_adapter(name: str | None, served: str, adapters: Iterable[str]) -> str | None:
    if name is None or name == served:
        return None
    if name in adapters:
        return name
    raise APIError(404, f"the model {name!r} does not exist; this server serves {served!r}",
                   param="model", code="model_not_found")


# ---- every other failure, in the same shape ---------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_, exc: APIError):
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    async def invalid(_, exc: InvalidRequestError):
        return APIError(400, str(exc), code=exc.code).response()

    @app.exception_handler(ModelNotFoundError)
    async def not_found(_, exc: ModelNotFoundError):  # a LoRA adapter unloaded meanwhile, or unknown
        return APIError(404, str(exc), param="model", code="model_not_found").response()

    @app.exception_handler(QueueFullError)
    async def queue_full(_, exc: QueueFullError):
        return APIError(429, f"the server is at capacity: {exc}", type="rate_limit_error", code="queue_full",
                        headers={"Retry-After": str(exc.retry_after_s)}).response()

    @app.exception_handler(OverloadedError)
    async def overloaded(_, exc: OverloadedError):
        return APIError(503, str(exc), type="server_error", code="overloaded",
                        headers={"Retry-After": str(exc.retry_after_s)}).response()

    @app.exception_handler(EngineDeadError)
    async def dead(_, exc: EngineDeadError):
        return APIError(503, str(exc), type="server_error", code="engine_dead").response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(_, exc: ClientDisconnect):  # left while sending the body: not a server error
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(RequestValidationError)
    async def validation(_, exc: RequestValidationError):  # FastAPI's own checks say 422; OpenAI says 400
        return bad_input(exc.errors()).response()

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception):
        # The detail goes to the log, not to the client: an exception's repr can hold paths, keys, prompts.
        logger.error("internal error on %s %s", request.method, request.url.path, exc_info=exc)
        return APIError(500, "internal error; the server's log has the detail", type="server_error").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_, exc: StarletteHTTPException):
        return APIError(exc.status_code, str(exc.detail), type="invalid_request_error",
                        headers=getattr(exc, "headers", None)).response()
