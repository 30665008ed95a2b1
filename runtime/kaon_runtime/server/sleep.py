"""Sleep and wake over HTTP, with vLLM's routes so that tools built for it work: `POST /sleep?level=1|2`,
`POST /wake_up`, `GET /is_sleeping` -> {"is_sleeping": bool}. What each level frees: engine/sleep.py.

Putting an engine to sleep administers it, so (like the adapter routes, lora_routes.py) the routes are
off (a 404, as routes that do not exist) unless `kaon serve --enable-sleep-mode`, and then answer
only the admin key (--admin-key, $KAON_ADMIN_KEY), which the operator holds and clients do not.

While asleep, and from the moment a sleep is asked for: /ready answers 503 (the router sends nothing),
/health stays 200 (the process is fine: a liveness probe must not restart it), and a generating
request that reaches the engine anyway gets a 503 with code `engine_asleep` and Retry-After, which
the router retries on another replica. /v1/models and /tokenize keep working, as vLLM's do.
A sleep first waits (up to --sleep-grace-period) for the requests in flight to finish, then aborts
what is left: the operator only puts an idle replica to sleep, so nothing should be.
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Depends, FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.sleep import EngineAsleepError, Sleep, put_to_sleep, unsupported, wake_up
from kaon_runtime.server import openapi as doc, protocol as p
from kaon_runtime.server.lora_routes import admin_allowed
from kaon_runtime.server.pipeline import RETRY_AFTER_S, APIError

logger = logging.getLogger("kaon.server")

ASLEEP_MESSAGE = "the engine is asleep (sleep mode): retry on another replica"
ASLEEP_HEADER = "Kaon-Engine-Asleep"
"""Marks the 503 so that kaon's router tries another replica without reading the body (its proxy.py)."""


@dataclass(slots=True)
class SleepState:
    asleep: bool = False
    """True from the moment a sleep is asked for until the wake has finished."""
    slept: Sleep | None = None
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one sleep or wake at a time

    @property
    def level(self) -> int:
        return 0 if self.slept is None else self.slept.level


def install(app: FastAPI, engine: AsyncEngine) -> None:
    """The routes, the state, and the engine's refusal of requests that arrive while it sleeps."""
    state = app.state.sleep = SleepState()
    engine.refuse_new = lambda: EngineAsleepError(ASLEEP_MESSAGE) if state.asleep else None
    app.add_exception_handler(EngineAsleepError, _asleep_response)
    app.include_router(routes)


def _asleep_error() -> APIError:
    return APIError(503, ASLEEP_MESSAGE, type="service_unavailable", code="engine_asleep",
                    headers={"Retry-After": str(RETRY_AFTER_S), ASLEEP_HEADER: "true"})


async def _asleep_response(_request: Request, _exc: Exception) -> Response:
    return _asleep_error().response()


async def awake(request: Request) -> None:
    """A dependency of the routes that run the model: 503 while the engine sleeps."""
    if request.app.state.sleep.asleep:
        raise _asleep_error()


def is_asleep(request: Request) -> bool:
    return request.app.state.sleep.asleep


async def admin_only(request: Request) -> None:
    """The sleep routes' gate, the encoder server's too: 404 while sleep mode is off, 401 without the admin key."""
    settings = request.app.state.settings
    refused = admin_allowed(settings.sleep_mode, settings.admin_key, request.headers.get("authorization", ""))
    if refused == 404:
        raise APIError(404, f"no route {request.url.path}: sleep mode is off (kaon serve --enable-sleep-mode)",
                       code="not_found")
    if refused is not None:
        raise APIError(401, "sleep and wake need the admin key (Authorization: Bearer <admin key>)",
                       code="invalid_api_key")


routes = APIRouter(dependencies=[Depends(admin_only)])
# Every route answers 404 when sleep mode is off and 401 without the admin key (admin_only).
ADMIN_ERRORS: doc.Responses = {
    401: {"model": p.ErrorResponse, "description": "Missing or wrong admin key"},
    404: {"model": p.ErrorResponse, "description": "Sleep mode is off (kaon serve --enable-sleep-mode)"}}
CHANGES: doc.Responses = {
    200: {"description": "Done (or already in that state)"},
    400: {"model": p.ErrorResponse, "description": "Not supported for this engine or level, or asleep at another"},
    **ADMIN_ERRORS}


@routes.post("/sleep", response_model=None, responses=CHANGES)
async def sleep(request: Request, level: int = 1) -> Response:
    state: SleepState = request.app.state.sleep
    engine: AsyncEngine = request.app.state.engine
    problem = unsupported(engine.engine, level)
    if problem is not None:
        raise APIError(400, problem, param="level", code="sleep_unsupported")
    async with state.lock:
        if state.slept is not None:
            if level != state.slept.level:
                raise APIError(400, f"the engine is asleep at level {state.slept.level}; wake it before "
                               f"sleeping at level {level}", param="level", code="already_asleep")
            return Response(status_code=200)  # asked twice: the same state, as vLLM answers
        state.asleep = True  # /ready turns 503 now, so the router stops sending while we wait
        started = time.monotonic()
        try:
            await _wait_idle(engine, request.app.state.settings.sleep_grace_s)
            state.slept = await engine.call(lambda e: put_to_sleep(e, level))
        except BaseException:
            state.asleep = False
            raise
    logger.info("asleep at level %d in %.2f s", level, time.monotonic() - started)
    return Response(status_code=200)


@routes.post("/wake_up", response_model=None, responses=CHANGES)
async def wake(request: Request, tags: Annotated[list[str] | None, Query()] = None) -> Response:
    if tags:  # vLLM's partial wakes (weights only, then the cache) serve weight updates, which kaon has not
        raise APIError(400, "waking by tags is not supported: POST /wake_up wakes the whole engine", param="tags",
                       code="unsupported_tags")
    state: SleepState = request.app.state.sleep
    engine: AsyncEngine = request.app.state.engine
    async with state.lock:
        slept = state.slept
        if slept is None:
            return Response(status_code=200)
        started = time.monotonic()
        await engine.call(lambda e: wake_up(e, slept))
        state.slept, state.asleep = None, False
    logger.info("awake from level %d in %.2f s", slept.level, time.monotonic() - started)
    return Response(status_code=200)


@routes.get("/is_sleeping", responses=ADMIN_ERRORS)
async def is_sleeping(request: Request) -> JSONResponse:
    return JSONResponse({"is_sleeping": request.app.state.sleep.asleep})


async def _wait_idle(engine: AsyncEngine, grace_s: float) -> None:
    """Until no request runs or waits in the engine, or grace_s has passed (the sleep aborts the rest)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if not (stats.num_running or stats.num_waiting or engine.engine.has_unfinished_requests()):
            return
        await asyncio.sleep(0.05)
