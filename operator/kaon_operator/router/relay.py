"""Passing an engine's response on to the client, once the pod has answered.

A small body of known length is read whole and sent in one write; any other is copied as it
arrives (pump.py), a stream in whole events (sse.py). The status, headers and body are the
engine's. A response that breaks off or goes idle after it began cannot change its status any
more: a stream ends with an OpenAI error event, any other body is left unfinished, and the pod
is ejected. A client that stopped reading (one write waited --write-timeout) is dropped at once,
its buffered bytes with it; leaving the response unread closes the engine's connection, so the
engine aborts the request. That is the client's doing: the pod is not ejected.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy

from kaon_operator import clock
from kaon_operator.router import errors
from kaon_operator.router.backoff import Backoff
from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.front import FrontRequest, Whole, open_stream
from kaon_operator.router.metrics import Phase, RouterMetrics
from kaon_operator.router.pump import Ended, Outcome, Pump
from kaon_operator.router.request import response_headers, response_lines
from kaon_operator.router.sse import EventFramer, Unframed
from kaon_operator.router.upstream import Response, UpstreamError

logger = logging.getLogger("kaon.router")

WHOLE_BODY_BYTES = 1 << 16  # a body of known length up to this is read whole, then sent in one write
STALLED_LOG_EVERY_S = 10.0  # many clients that stop reading at once make one line, not one each


class Tap(Protocol):
    headers: dict[str, str]

    async def tee(self, data: bytes) -> None: ...

    def done(self, status: int, content_type: str) -> None: ...


def _tapped(write: Callable[[bytes], Awaitable[None]], tap: Tap) -> Callable[[bytes], Awaitable[None]]:
    async def tapped(data: bytes) -> None:
        await tap.tee(data)
        await write(data)
    return tapped


class Relay:
    def __init__(self, idle_timeout: float, write_timeout: float, metrics: RouterMetrics, backoff: Backoff[Endpoint],
                 eject: Callable[[ServiceKey, Endpoint, str], None]):
        self.idle_timeout, self.write_timeout = idle_timeout, write_timeout
        self.metrics, self.backoff, self.eject = metrics, backoff, eject
        self._stalled_unlogged, self._stalled_logged_at = 0, float("-inf")

    async def __call__(self, request: web.Request | FrontRequest, upstream: Response, key: ServiceKey,
                       target: Endpoint, overhead: float, tap: Tap | None = None) -> web.StreamResponse | Whole:
        """`overhead`: the router's time before the upstream request went out. `tap`: an InferenceRoute's
        (router/route_gateway.py): its headers are added, and it sees the body as it is passed on."""
        async with upstream:  # releases the connection, or closes it when the body was not read to the end
            received = time.perf_counter()
            sse = upstream.content_type == "text/event-stream"
            length = upstream.content_length
            at_once = not sse and length is not None and length <= WHOLE_BODY_BYTES
            if at_once and tap is None and isinstance(request, FrontRequest):
                # The router's own server: the engine's field lines as they came, no web.Response (front.Whole).
                body = await self._whole(upstream, key, target, overhead, received)
                return Whole(upstream.status, upstream.reason, *response_lines(upstream.raw_headers), body)
            headers: CIMultiDict | CIMultiDictProxy = response_headers(upstream.raw_headers, drop_length=at_once)
            if tap is not None:  # (without Content-Length when at_once: the Response sets it then)
                headers = CIMultiDict(headers)  # response_headers' result is shared and read-only
                headers.update(tap.headers)
            if at_once:
                body = await self._whole(upstream, key, target, overhead, received)
                whole = web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)
                if tap is not None:
                    await tap.tee(body)
                    tap.done(upstream.status, upstream.headers.get("Content-Type", ""))
                return whole
            response = await open_stream(request, upstream.status, upstream.reason, headers)
            self._answered(key, target, upstream.status, overhead + time.perf_counter() - received)
            framer = EventFramer() if sse else Unframed()
            write = response.write if tap is None else _tapped(response.write, tap)
            try:
                ended = await Pump(upstream.content, write, framer, self.idle_timeout,
                                   self.write_timeout).run()
                if ended.outcome is Outcome.COMPLETE:
                    await response.write_eof()
                    if tap is not None:
                        tap.done(upstream.status, upstream.headers.get("Content-Type", ""))
                    return response
                if ended.outcome is Outcome.STALLED:
                    self._drop_stalled(request, key, target)
                    return response
            except ConnectionResetError:  # the client went away; closing the upstream aborts the request
                return response
            await self._broke_off(request, response, key, target, ended, sse)
            return response

    def whole_now(self, request: web.Request | FrontRequest, upstream: Response, key: ServiceKey, target: Endpoint,
                  overhead: float) -> Whole | None:
        """The common answer, at once: a small body that came with the head, for the router's own server, taken whole
        (what `_whole` reads, without its coroutines), the connection back to the pool, the engine's field lines as
        they came (front.Whole). None when the answer is not that (the relay's coroutine passes it on)."""
        if not upstream.complete or not isinstance(request, FrontRequest):
            return None
        received = time.perf_counter()
        length = upstream.content_length
        if length is None or length > WHOLE_BODY_BYTES or upstream.content_type == "text/event-stream" \
                or (body := upstream.body_now()) is None:
            return None
        upstream.release()
        self._answered(key, target, upstream.status, overhead + time.perf_counter() - received)
        return Whole(upstream.status, upstream.reason, *response_lines(upstream.raw_headers), body)

    def _drop_stalled(self, request: web.Request | FrontRequest, key: ServiceKey, target: Endpoint) -> None:
        """Abort, not close: a close waits for the buffered bytes to reach a client that never reads."""
        self.metrics.stalled_clients.labels(*key).inc()
        self._stalled_unlogged += 1
        now = clock.monotonic()
        if now - self._stalled_logged_at >= STALLED_LOG_EVERY_S:
            logger.warning("dropped %d client(s) that stopped reading (a write waited %gs, --write-timeout), the "
                           "last %s for %s/%s; their engine requests are cancelled", self._stalled_unlogged,
                           self.write_timeout, request.remote or "?", key.namespace, key.name)
            self._stalled_unlogged, self._stalled_logged_at = 0, now
        if request.transport is not None:
            request.transport.abort()

    def _answered(self, key: ServiceKey, target: Endpoint, status: int, added: float) -> None:
        self.metrics.added_latency.observe(added)
        self.metrics.count(key, status)
        self.backoff.succeed(target)

    async def _whole(self, upstream: Response, key: ServiceKey, target: Endpoint, overhead: float,
                     received: float) -> bytes:
        """A small body of known length (a completion without `stream`, an error) is read whole
        and sent with the headers in one write: one system call fewer per request than
        streaming it, and a failure while reading it can still be the router's own 502/504."""
        started = time.perf_counter()
        try:
            if upstream.complete:  # the body came with the head: nothing to wait for
                body = await upstream.read()
            else:
                async with asyncio.timeout(self.idle_timeout):
                    body = await upstream.read()
            read = time.perf_counter()
        except TimeoutError:
            self.metrics.timeouts.labels(*key, Phase.IDLE).inc()
            self.eject(key, target, f"response broke off: nothing sent for {self.idle_timeout:g}s")
            raise errors.upstream_timeout(str(key), target.pod, "data", self.idle_timeout) from None
        except UpstreamError as exc:
            reason = str(exc) or type(exc).__name__
            self.eject(key, target, f"response broke off: {reason}")
            raise errors.upstream_broke_off(str(key), target.pod, reason) from None
        # The router's part only: not the time the engine took to send the body.
        self._answered(key, target, upstream.status, overhead + started - received + time.perf_counter() - read)
        return body

    async def _broke_off(self, request: web.Request | FrontRequest, response: web.StreamResponse, key: ServiceKey,
                         target: Endpoint, ended: Ended, sse: bool) -> None:
        """Headers are out, so the status cannot say it. A stream ends with an error event as
        OpenAI's does (its clients raise it); any other body is left unfinished, which clients
        see as a broken response rather than a short, valid-looking one."""
        if ended.outcome is Outcome.IDLE:
            self.metrics.timeouts.labels(*key, Phase.IDLE).inc()
            reason = f"nothing sent for {self.idle_timeout:g}s"
            error = errors.upstream_timeout(str(key), target.pod, "data", self.idle_timeout)
        else:
            reason = ended.reason
            error = errors.upstream_broke_off(str(key), target.pod, reason)
        self.metrics.broken.labels(*key).inc()
        self.eject(key, target, f"response broke off: {reason}")
        if sse:
            try:
                await response.write(errors.stream_event(error))
                await response.write_eof()
                return
            except ConnectionResetError:
                pass
        if request.transport is not None:
            request.transport.close()
