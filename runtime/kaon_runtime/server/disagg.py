"""Prefill/decode disaggregation, the server's side (docs/disaggregation.md).

`--role prefill` (and `both`) serve `POST /kaon/v1/kv/prefill`: a decode engine sends a prompt's token
ids and the first token it lacks; the answer streams that prompt's K/V in frames (engine/kv_wire.py)
as the engine's steps compute it. A decode engine that goes away mid-transfer closes the connection:
the request is aborted and its blocks go back to the pool at once.

`--role decode` points the engine at `--prefill-url`s (engine/remote_prefill.py). Either role adds the
transfer's metrics to /metrics.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import uuid
from collections.abc import AsyncIterator

import torch
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import StreamingResponse
from prometheus_client import Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field, model_validator

from kaon_runtime.engine.async_engine import AsyncEngine, RequestStream
from kaon_runtime.engine.kv_transfer import FALLBACK_REASONS, KvExports, TransferStats, prefill_params
from kaon_runtime.engine.kv_wire import (
    PREFILL_PATH,
    NixlWriter,
    chunk_frame_parts,
    done_frame,
    error_frame,
    frame,
    meta_frame,
)
from kaon_runtime.engine.llm_engine import LLMEngine
from kaon_runtime.engine.remote_prefill import RemotePrefill
from kaon_runtime.server.app import _authorized, _not_draining

log = logging.getLogger("uvicorn.error")

ROLES = ("both", "prefill", "decode")
# Per transfer: from a millisecond (a few blocks on one host) to a minute (a long prompt on a slow CPU).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class NixlPeer(BaseModel):
    agent: str = Field(min_length=1, max_length=128)
    metadata: str  # base64 of its agent metadata
    addr: int = Field(gt=0)


class PrefillAsk(BaseModel):
    """A decode engine's request: the whole prompt, and the first token whose K/V it lacks."""

    token_ids: list[int] = Field(min_length=2)
    start: int = Field(ge=0)
    adapter: str | None = None
    cache_salt: str | None = None
    nixl: NixlPeer | None = None  # the decode engine's NIXL agent and staging range: the bytes go there



    @model_validator(mode="after")
    def _start_within(self) -> PrefillAsk:
        if self.start >= len(self.token_ids) - 1:
            raise ValueError("start must be below the prompt's last token (which the decode engine computes)")
        return self


routes = APIRouter()


@routes.post(PREFILL_PATH, include_in_schema=False)
async def prefill(ask: PrefillAsk, request: Request) -> StreamingResponse:
    engine: AsyncEngine = request.app.state.engine
    exports: KvExports = engine.engine.kv_exports
    end = len(ask.token_ids) - 1
    request_id = f"kvx-{uuid.uuid4().hex}"
    queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
    loop = asyncio.get_running_loop()

    def sink(first: int, kv: torch.Tensor | None) -> None:  # the engine thread, after each step
        loop.call_soon_threadsafe(queue.put_nowait, ("chunk", (first, kv)) if kv is not None else ("done", None))

    exports.watch(request_id, ask.start, end, sink)
    try:
        stream = await engine.add_request(request_id, ask.token_ids[:end], prefill_params(ask.cache_salt), ask.adapter)
    except BaseException:
        exports.drop(request_id)
        raise
    watcher = asyncio.create_task(_watch_engine(stream, queue))
    return StreamingResponse(_frames(exports, ask, queue, stream, watcher),
                             media_type="application/octet-stream")


async def _watch_engine(stream: RequestStream, queue: asyncio.Queue) -> None:
    """The request's end, or its error, as a frame-queue item (a finished request before `done` is a failure)."""
    try:
        async for _ in stream:
            pass
        queue.put_nowait(("ended", "the prefill request ended before its K/V was sent"))
    except Exception as exc:  # noqa: BLE001 -- whatever the engine says goes to the decode engine as an error frame
        queue.put_nowait(("ended", f"the prefill engine failed: {exc}"))


async def _frames(exports: KvExports, ask: PrefillAsk, queue: asyncio.Queue, stream: RequestStream,
                  watcher: asyncio.Task) -> AsyncIterator[bytes | memoryview]:
    start, end = ask.start, len(ask.token_ids) - 1
    try:
        yield meta_frame(exports.layout, start, end)
        while True:
            kind, item = await queue.get()
            if kind == "chunk":
                first, kv = item
                if ask.nixl is None:
                    head, payload = chunk_frame_parts(first, kv)
                    yield head
                    yield payload  # the K/V's own memory: no copy before the socket
                    continue
                # NIXL: the bytes into the decode engine's staging range, the header on the stream once they landed
                try:
                    await asyncio.to_thread(_nixl_writer().write, ask.nixl.model_dump(),
                                            (first - start) * exports.layout.token_bytes, kv)
                except Exception as exc:  # noqa: BLE001 -- the decode engine prefills itself; it reads why
                    log.warning("NIXL write to %s failed: %r", ask.nixl.agent, exc)
                    yield error_frame(f"the NIXL write failed: {exc!r}")
                    return
                yield frame({"type": "chunk", "first": first, "tokens": kv.shape[3], "placed": True})
            elif kind == "done":
                yield done_frame()
                return
            else:
                yield error_frame(str(item))
                return
    finally:  # done, or the decode engine went away: either way its blocks go back now
        stream.abort()
        exports.drop(stream.request_id)
        watcher.cancel()


@functools.cache
def _nixl_writer() -> NixlWriter:
    """This engine's NIXL agent, started by the first decode engine that offers a staging range."""
    return NixlWriter()


class _TransferCollector(Collector):
    def __init__(self, engine: LLMEngine, remote: RemotePrefill | None):
        self._engine, self._remote = engine, remote

    def collect(self):
        stats = self._remote.stats if self._remote is not None else TransferStats()
        tokens = CounterMetricFamily("kaon_kv_transfer_tokens", "Prompt tokens whose K/V moved between engines "
                                     "(disaggregated prefill).", labels=["direction"])
        tokens.add_metric(["sent"], self._engine.kv_exports.sent_tokens)
        tokens.add_metric(["received"], stats.received_tokens)
        yield tokens
        fallbacks = CounterMetricFamily("kaon_kv_transfer_fallbacks", "Prompts a decode engine asked a prefill "
                                        "engine for and prefilled itself instead, by why.", labels=["reason"])
        for reason in FALLBACK_REASONS:
            count = self._engine.kv_imports_evicted if reason == "evicted" else stats.fallbacks[reason]
            fallbacks.add_metric([reason], count)
        yield fallbacks


def install(app: FastAPI, engine: AsyncEngine, role: str, remote: RemotePrefill | None) -> None:
    """Serve the prefill route (roles prefill and both), attach the prefill engines (decode), add the metrics."""
    if role in ("prefill", "both"):
        app.include_router(routes, dependencies=[Depends(_authorized), Depends(_not_draining)])
    engine.remote_prefill = remote
    registry = app.state.metrics.registry
    registry.register(_TransferCollector(engine.engine, remote))
    seconds = Histogram("kaon_kv_transfer_seconds", "Time to receive one prompt's K/V from a prefill engine "
                        "(its prefill included: blocks move as they are computed).", buckets=TRANSFER_BUCKETS,
                        registry=registry)
    if remote is not None:
        remote.observe = seconds.observe
        remote.engine_call = engine.call  # chunks go into blocks reserved on the engine thread as they arrive
    if remote is None:
        log.info("disaggregation: role %s", role)
    else:
        log.info("disaggregation: role decode, prefill engines %s, K/V transport %s%s, prompts of %d+ uncached "
                 "tokens prefilled there", [p.url for p in remote.peers], remote.transport.name,
                 f" (NIXL not used: {remote.why_not_nixl})" if remote.why_not_nixl else "", remote.min_prompt_tokens)
