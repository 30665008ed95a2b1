"""The router's own HTTP/1.1 server for its main port: an asyncio Protocol that parses requests with
httptools (llhttp, the parser the engine client uses too: upstream.py) and writes responses straight
to the socket, in place of aiohttp's server, which cost about a quarter of the router's CPU per request.

The handlers stay the router's (proxy.py): they get a `FrontRequest`, which offers the part of aiohttp's
web.Request they read (headers, raw fields, the body, the peer, the transport), and answer with an
aiohttp web.Response, written here in one go, or a stream opened with `open_stream` (chunked). What
aiohttp's server did and this one does the same way:
- --header-timeout: a connection waiting that long for a whole request head (new, or kept alive between
  requests) is closed without an answer; the body has its own deadline (proxy.py).
- A client that hangs up cancels its request's handler (the engine's request is aborted with it).
- Keep-alive and pipelining: requests on one connection are answered in order, one at a time; a
  second request's head pauses reading until the first is answered. `Connection: close`, HTTP/1.0
  without keep-alive, a refusal before the body was read, a body not read to its end, or a stream
  that did not end close the connection after the answer; a body left unread is read and dropped
  for LINGER_S first, so that the client sees the answer rather than a reset.
- `Expect: 100-continue` is answered when the handler reads the body (a refusal on the head goes
  out without it).
- Bodies past --max-body-bytes stop being kept (the handler answers 413); a request head past
  MAX_HEAD_BYTES or MAX_FIELDS is a 431, a malformed request a 400, each in OpenAI's error shape and
  closed; never a stack trace. A handler that fails is logged and answered 500.

Over 300 lines for a stated reason: one connection's parser callbacks, its deadlines, its queue of
pipelined requests and its writes share one state machine; split apart, each part would reach into the
others' fields (as upstream.py's client, its mirror on the engine side).
"""
from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from typing import Any, cast

import httptools
from aiohttp import web
from multidict import CIMultiDict, CIMultiDictProxy
from yarl import URL

from kaon_operator.router import errors
from kaon_operator.router.upstream import content_length_line

logger = logging.getLogger("kaon.router")

LINGER_S = 1.0
MAX_HEAD_BYTES = 64 << 10
"""A request head (request line and fields) larger than this is refused (aiohttp's limit: 8190 bytes a line)."""
MAX_FIELDS = 128
MAX_LINE_BYTES = 8190
_METHODS = {m.encode(): m for m in ("GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS", "PATCH")}
"""The common methods' names as str, made once."""

Handler = Callable[[Any], Awaitable[Any]]
"""A router handler: takes a FrontRequest (or aiohttp's request: the same handlers serve aiohttp's app)."""


class FrontRequest:
    """One request as the router's handlers read it (the part of aiohttp's web.Request they use)."""

    __slots__ = ("conn", "method", "raw_url", "path", "query", "canonical", "raw_headers", "_headers",
                 "content_length", "_chunks", "size", "complete", "too_large", "_waiter", "keep_alive",
                 "expect_continue", "head_done", "http10", "error", "authorization")

    def __init__(self, conn: FrontProtocol):
        self.conn = conn
        self.raw_url = b""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self.content_length: int | None = None
        self._chunks: list[bytes] = []
        self.size = 0
        self.complete = self.too_large = self.expect_continue = self.head_done = self.http10 = False
        self._waiter: asyncio.Future[None] | None = None
        self.error: errors.RouterError | None = None
        """Set when the body turned out malformed: reading it raises this."""
        self.keep_alive = True
        self.method = self.path = self.query = ""
        self.canonical: str | None = None
        """The route as listed, when the path names one of the router's routes."""
        self.authorization: str | None = None
        """The first Authorization field, noted as the head is read: no `headers` built for it (authorization())."""

    # what the handlers read ---------------------------------------------------------------

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        if self._headers is None:
            self._headers = CIMultiDictProxy(CIMultiDict(
                (n.decode("latin-1"), v.decode("utf-8", "surrogateescape")) for n, v in self.raw_headers))
        return self._headers

    @property
    def remote(self) -> str | None:
        return self.conn.remote

    @property
    def transport(self) -> asyncio.Transport | None:
        return self.conn.transport

    @property
    def content(self) -> FrontRequest:
        return self

    def is_eof(self) -> bool:
        return self.complete

    async def read(self) -> bytes:
        if not self.complete:
            if self.expect_continue:
                self.expect_continue = False
                self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        if self.error is not None:
            raise self.error
        if self.too_large:
            raise errors.too_large(self.conn.front.max_body_bytes)
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    def body_now(self) -> bytes | None:
        """The whole body when all of it is in and kept: what `read` returns at once, without a coroutine; else None
        (`read` waits for it, or raises the refusal)."""
        if not self.complete or self.error is not None or self.too_large:
            return None
        return self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)

    # fed by the protocol ---------------------------------------------------------------------

    def body(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.conn.front.max_body_bytes:
            self.too_large = True
            self._chunks.clear()
        elif not self.too_large:
            self._chunks.append(data)

    def fail(self, error: errors.RouterError) -> None:
        self.error = error
        self.finish()

    def finish(self) -> None:
        self.complete = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


def authorization(request: Any) -> str | None:
    """The request's Authorization header (the first), on either server: ours notes it while parsing."""
    if isinstance(request, FrontRequest):
        return request.authorization
    return request.headers.get("Authorization")


class Front:
    """The protocol factory of the main port (edge.py puts the connection cap in front of it)."""

    def __init__(self, routes: dict[tuple[str, str], Handler], default: Handler, max_body_bytes: int,
                 header_timeout: float, now: dict[tuple[str, str], Callable[[FrontRequest], bool]] | None = None):
        self.routes, self.default = routes, default
        self.now = now or {}
        """Per route, its handler's synchronous start (proxy.Router._forward_now, fast.py), tried first on a request
        whose body came whole in the read that ended it: True when it took the request (it answers it itself, through
        answer_now or hand_over); False: the route's handler is run as a task, as for any request."""
        self.max_body_bytes, self.header_timeout = max_body_bytes, header_timeout
        self.connections: set[FrontProtocol] = set()

    def __call__(self) -> FrontProtocol:
        return FrontProtocol(self)

    def handler(self, request: FrontRequest) -> Handler:
        found = self.routes.get((request.method, request.path))
        if found is None and request.method == "HEAD":
            found = self.routes.get(("GET", request.path))
        if found is not None:
            request.canonical = request.path
            return found
        return self.default

    def start_now(self, request: FrontRequest) -> bool:
        start = self.now.get((request.method, request.path))
        if start is None:
            return False
        request.canonical = request.path
        return start(request)

    def close(self) -> None:
        for conn in list(self.connections):
            conn.close()


FRONT: web.AppKey[Callable[[float], Front]] = web.AppKey("kaon_front")
"""On the router's app (proxy.Router.app): makes the Front that edge.serving puts on the port in place of
aiohttp's server, given the --header-timeout."""

_date_cache: list[Any] = [0, b""]


def _date() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0], _date_cache[1] = now, formatdate(now, usegmt=True).encode()
    return _date_cache[1]


class FrontProtocol(asyncio.Protocol):
    """One client connection."""

    def __init__(self, front: Front):
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.loop: asyncio.AbstractEventLoop
        self.remote: str | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: collections.deque[FrontRequest] = collections.deque()
        self.parsing: FrontRequest | None = None
        self.head_bytes = 0
        self.fields = 0
        self.line_http11 = False
        """The read that began the message being parsed began with a request line ending in ` HTTP/1.1`."""
        self.task: asyncio.Task | None = None
        self.head_timer: asyncio.TimerHandle | None = None
        self.head_due: float | None = None
        """When the awaited request head is due (the event loop's clock), or None while none is awaited."""
        self.paused_reading = False
        self.paused_writing: asyncio.Future[None] | None = None
        self.closing = False
        self.lingering = False
        self.refusal: errors.RouterError | None = None
        """A malformed request pipelined behind one being answered: answered after it."""
        self.deferred: FrontRequest | None = None
        """The request to answer whose head is in and whose body is not yet: started when its body ends in this read
        (Front.start_now first), else at the read's end (as a task)."""
        self.exchange: Any = None
        """The request answered on the fast path (fast.Exchange), until it is answered or the coroutine path began on
        it: told when the client goes away (abandon)."""

    # connection -------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass (uvloop's is not).
        self.transport = cast(asyncio.Transport, transport)
        self.loop = asyncio.get_running_loop()  # kept: each get_running_loop() asks the system for the process id
        peer = transport.get_extra_info("peername")
        self.remote = peer[0] if isinstance(peer, tuple) else None
        self.front.connections.add(self)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self.closing = True
        self._drop_head_timer()
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: its request ends (the engine's is aborted)
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.abandon()  # (unless the task above began on it: its cancellation ends it)
        if self.paused_writing is not None and not self.paused_writing.done():
            self.paused_writing.set_exception(ConnectionResetError("the client closed the connection"))
            # Marked as seen: a drain waiting on it gets the error through its shield; with none waiting (the
            # request's task was cancelled just above) asyncio would log "exception was never retrieved".
            self.paused_writing.exception()
        self.transport = None

    def eof_received(self) -> bool | None:
        if self.lingering:
            self.close()
        return None

    def pause_writing(self) -> None:
        if self.paused_writing is None or self.paused_writing.done():
            self.paused_writing = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.paused_writing is not None and not self.paused_writing.done():
            self.paused_writing.set_result(None)

    async def drain(self) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        if self.paused_writing is not None and not self.paused_writing.done():
            await asyncio.shield(self.paused_writing)

    def write(self, data: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.transport.write(data)

    def close(self) -> None:
        self.closing = True
        self._drop_head_timer()
        if self.transport is not None:
            self.transport.close()

    def _await_head(self) -> None:
        """From now the next request's head is due within --header-timeout. One timer per connection is kept armed
        and looks again when it fires (a kept-alive connection's next request moves the deadline on): no timer made
        and cancelled per request."""
        loop = self.loop
        self.head_due = loop.time() + self.front.header_timeout
        if self.head_timer is None:
            self.head_timer = loop.call_at(self.head_due, self._head_overdue)

    def _head_overdue(self) -> None:
        self.head_timer = None
        if self.head_due is None or self.closing:
            return  # a request is being answered: its next head's deadline starts after it (_await_head)
        loop = self.loop
        if loop.time() >= self.head_due:
            self.close()
        else:
            self.head_timer = loop.call_at(self.head_due, self._head_overdue)

    def _cancel_head_timer(self) -> None:
        self.head_due = None  # the armed timer, if any, finds nothing due and lapses

    def _drop_head_timer(self) -> None:
        """The connection is done: its timer goes (it would hold the connection until it fired)."""
        self.head_due = None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    # parsing ----------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self.lingering or self.closing or self.refusal is not None:
            return  # after a refusal: read and dropped until LINGER_S has passed
        if self.parsing is None:
            self.head_bytes += len(data)
            # A message begins in this read: its version read off its request line when plainly there, for
            # on_headers_complete (httptools' get_http_version formats a str: ~0.7 us a request).
            self.line_http11 = _line_http11(data)
        elif not self.parsing.head_done:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self.parsing is not None:
                self.parsing.keep_alive = False
        except httptools.HttpParserCallbackError as exc:
            cause = exc.__context__
            if isinstance(cause, errors.RouterError):
                self._refuse(cause)
            else:
                logger.exception("parsing a request failed", exc_info=cause)
                self._refuse(errors.bad_request("the HTTP request is malformed"))
        except httptools.HttpParserError as exc:
            self._refuse(errors.bad_request(f"the HTTP request is malformed: {exc}"))
        else:
            if self.parsing is not None and not self.parsing.head_done and self.head_bytes > MAX_HEAD_BYTES:
                self._refuse(_head_too_large())
        if self.deferred is not None:  # its body is still coming (or was refused part way): the task reads it
            request, self.deferred = self.deferred, None
            self._start(request)

    def on_message_begin(self) -> None:
        self.parsing = FrontRequest(self)
        self.fields = 0

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self.parsing.raw_url += url
        if len(self.parsing.raw_url) > MAX_LINE_BYTES:
            raise errors.RouterError(414, f"the request URL is longer than {MAX_LINE_BYTES} bytes",
                                     "invalid_request_error", "url_too_long")

    def on_header(self, name: bytes, value: bytes) -> None:
        request = self.parsing
        assert request is not None
        self.fields += 1
        size = len(name)
        if self.fields > MAX_FIELDS or size + len(value) > MAX_LINE_BYTES:
            raise _head_too_large()
        request.raw_headers.append((name, value))
        # The three fields the router reads, noted here (the length first: most fields skip the compare). The last
        # Content-Length counts, the first Authorization (as `headers` reads it); a chunked body's trailer fields
        # (after the head) are kept but none of these.
        if request.head_done:
            pass
        elif size == 14:
            if name.lower() == b"content-length":
                request.content_length = int(value) if value.strip().isdigit() else None
        elif size == 6:
            if name.lower() == b"expect" and value.lower() == b"100-continue":
                request.expect_continue = True
        elif size == 13 and request.authorization is None and name.lower() == b"authorization":
            request.authorization = value.decode("utf-8", "surrogateescape")

    def on_headers_complete(self) -> None:
        request = self.parsing
        assert request is not None
        request.head_done = True
        self.head_bytes = 0
        parser = self.parser
        method = parser.get_method()
        request.method = _METHODS.get(method) or method.decode("ascii", "replace")
        if self.line_http11:
            self.line_http11 = False  # (the first message of the read only: a pipelined one asks the parser)
        else:
            request.http10 = parser.get_http_version() == "1.0"
        request.keep_alive = parser.should_keep_alive()
        raw = request.raw_url
        known = _TARGETS.get(raw)
        if known is None:
            known = _target(raw)
            if len(raw) <= MAX_KEPT_TARGET and len(_TARGETS) < MAX_TARGETS:
                _TARGETS[raw] = known
        request.path, request.query = known
        if self.closing or self.lingering:
            return  # a request answered with a close earlier in this read (answer_now): what follows is nobody's
        self.queue.append(request)
        if len(self.queue) == 1:
            self._cancel_head_timer()
            if self.front.now:
                self.deferred = request  # started once its body is in (on_message_complete), or the read is parsed
            else:
                self._start(request)
        elif not self.paused_reading and self.transport is not None:
            self.paused_reading = True  # pipelined: the next is read once this one is answered
            self.transport.pause_reading()

    def on_body(self, data: bytes) -> None:
        assert self.parsing is not None
        self.parsing.body(data)

    def on_message_complete(self) -> None:
        request = self.parsing
        assert request is not None
        self.parsing = None
        request.finish()
        if self.deferred is request:
            self.deferred = None
            self._start_now(request)

    # answering --------------------------------------------------------------------------------

    def _start(self, request: FrontRequest) -> None:
        self.task = self.loop.create_task(self._answer(request))

    def _start_now(self, request: FrontRequest) -> None:
        """A request whose body is in: its route's synchronous start if it has one and takes it, else a task."""
        try:
            if self.front.start_now(request):
                return
        except Exception:  # (after a part of it ran: the request ends here, as a failed handler's does)
            logger.exception("a request to %s failed in the router", request.path)
            self.exchange = None
            response = errors.RouterError(500, "the router failed on this request", "server_error").response()
            response.force_close()
            self.answer_now(request, response)
            return
        self._start(request)

    def hand_over(self, request: FrontRequest, handling: Awaitable[Any]) -> None:
        """The fast path's request goes on as a task (fast.Exchange.hand_over), `handling` its handler's coroutine."""
        self.task = self.loop.create_task(self._answer(request, handling))

    def answer_now(self, request: FrontRequest, response: web.Response | Whole) -> None:
        """A whole answer to the request being answered, written now (the fast path's), then the next request."""
        self.exchange = None
        if self.transport is None:
            return
        try:
            keep = self._write_whole(request, response)
        except ConnectionResetError:
            return
        except Exception:  # as _answer: logged, and the connection closed (no half answer)
            logger.exception("answering a request to %s failed in the router", request.path)
            self.close()
            return
        self._next(request, keep and request.keep_alive and request.complete)

    async def _answer(self, request: FrontRequest, handling: Awaitable[Any] | None = None) -> None:
        try:
            response = await (self.front.handler(request)(request) if handling is None else handling)
        except asyncio.CancelledError:
            return
        except errors.RouterError as exc:
            response = exc.response()
        except Exception:
            logger.exception("a request to %s failed in the router", request.path)
            response = errors.RouterError(500, "the router failed on this request", "server_error").response()
            response.force_close()
        if self.transport is None:
            return
        try:
            if isinstance(response, Whole):  # (first: the common answer)
                keep = self._write_lines(request, response)
            elif isinstance(response, FrontStream):
                if not response.finished:
                    await response.write_eof()
                keep = response.keep_alive
            else:
                keep = self._write_whole(request, response)
        except ConnectionResetError:
            return
        except Exception:  # an answer that cannot be written: logged, and the connection closed (no half answer)
            logger.exception("answering a request to %s failed in the router", request.path)
            self.close()
            return
        self._next(request, keep and request.keep_alive and request.complete)

    def _write_whole(self, request: FrontRequest, response: web.Response | Whole) -> bool:
        if isinstance(response, Whole):
            return self._write_lines(request, response)
        body = response.body
        if body is None:
            body = b""
        elif not isinstance(body, bytes | bytearray):  # the router's handlers answer bytes only
            raise TypeError(f"the router cannot send a {type(body).__name__} body")
        keep = response.keep_alive is not False and request.keep_alive and request.complete
        head = _head(request, response.status, response.reason, response.headers, keep)
        head.append(b"Content-Length: %d\r\n\r\n" % len(body))
        if request.method != "HEAD" and body:
            head.append(bytes(body))
        self.write(b"".join(head))
        return keep

    def _write_lines(self, request: FrontRequest, response: Whole) -> bool:
        keep = request.keep_alive and request.complete
        body = response.body
        self.write(b"".join((
            _status_line(response.status, response.reason), response.lines,
            b"" if response.dated else b"Date: " + _date() + b"\r\n",
            b"" if keep else b"Connection: close\r\n",
            b"Connection: keep-alive\r\n" if keep and request.http10 else b"",
            content_length_line(len(body)), b"\r\n", body if request.method != "HEAD" else b"")))
        return keep

    def _next(self, request: FrontRequest, keep: bool) -> None:
        self.queue.popleft()
        self.task = None
        self.exchange = None
        if self.refusal is not None and keep:  # (after a close, what follows is nobody's)
            self.queue.clear()
            self._refuse(self.refusal)
            return
        if not keep:
            self.queue.clear()
            if (request.complete and not self.lingering) or self.transport is None:
                self.close()
            else:  # the body is still coming (or was malformed part way: the rest may be): read and drop it a while,
                # so the client sees the answer rather than a reset (uvloop's loop closed before reading it more often)
                self.lingering = True
                if self.transport.can_write_eof():
                    self.transport.write_eof()
                asyncio.get_running_loop().call_later(LINGER_S, self.close)
                if self.paused_reading:
                    self.transport.resume_reading()
            return
        if self.paused_reading and len(self.queue) < 2 and self.transport is not None:
            self.paused_reading = False
            self.transport.resume_reading()
        if self.queue:
            self._start(self.queue[0])
        else:
            self._await_head()

    def _refuse(self, error: errors.RouterError) -> None:
        """A request that cannot be read (malformed, a head too large): its error, then closed."""
        if self.closing or self.transport is None:
            return
        request = self.parsing
        if request is not None and request.head_done and self.queue and self.queue[0] is request:
            # Its body is malformed (bad chunked encoding) while it is being answered: reading it fails.
            request.keep_alive = False
            request.fail(error)
            self.lingering = True
            return
        if self.task is not None or self.exchange is not None or self.deferred is not None:
            # pipelined behind a request being answered: refused once that one is
            self.refusal = error
            if not self.paused_reading:
                self.paused_reading = True
                self.transport.pause_reading()
            return
        body = json.dumps(error.body()).encode()
        self.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nConnection: close\r\n"
                   b"Content-Length: %d\r\n\r\n%s" % (error.status, _reason(error.status), len(body), body))
        self.lingering = True
        if self.transport.can_write_eof():
            self.transport.write_eof()
        if self.paused_reading:
            self.transport.resume_reading()
        asyncio.get_running_loop().call_later(LINGER_S, self.close)


MAX_TARGETS = 1024
MAX_KEPT_TARGET = 256
_TARGETS: dict[bytes, tuple[str, str]] = {}
"""Request targets as they came -> (path, query) (_target): clients send the same few (the same str objects then, their
hashes kept for the routes' lookup). Bounded: a client may send any; past the bound the rest are read each time."""


def _target(raw: bytes) -> tuple[str, str]:
    """The path and query of a request target."""
    path, _, query = raw.partition(b"?")
    if b"%" in path or b"/." in path or not path.startswith(b"/"):
        # Percent-escapes, dot segments, an absolute URL: read as aiohttp's router did (yarl).
        try:
            url = URL(raw.decode("utf-8", "surrogateescape"), encoded=True)
            return url.path, url.raw_query_string
        except ValueError:
            raise errors.bad_request("the request URL is malformed") from None
    return path.decode("latin-1"), query.decode("latin-1")


def _line_http11(data: bytes) -> bool:
    """Whether `data` begins with a request line that ends in ` HTTP/1.1` and its CRLF, with no other LF before it: then
    the message that httptools parses from it is HTTP/1.1 (anything else, such as a leading CRLF or a line split
    across reads, is left to get_http_version)."""
    lf = data.find(b"\n")
    return lf > 10 and data.startswith(b" HTTP/1.1\r", lf - 10)


def _head_too_large() -> errors.RouterError:
    return errors.RouterError(431, f"the request head is larger than the router reads ({MAX_HEAD_BYTES} bytes, "
                              f"{MAX_FIELDS} fields, {MAX_LINE_BYTES} bytes a field)", "invalid_request_error",
                              "request_header_fields_too_large")


_status_lines: dict[tuple[int, str], bytes] = {}


def _status_line(status: int, reason: str) -> bytes:
    """`HTTP/1.1 <status> <reason>` and its CRLF, made once per status and reason (an engine's: a few)."""
    line = _status_lines.get((status, reason))
    if line is None:
        line = b"HTTP/1.1 %d %s\r\n" % (status, reason.encode("latin-1", "replace") or _reason(status))
        if len(_status_lines) < 256 and len(reason) <= 64:
            _status_lines[(status, reason)] = line
    return line


def _reason(status: int) -> bytes:
    from http import HTTPStatus
    try:
        return HTTPStatus(status).phrase.encode()
    except ValueError:
        return b""


def _head(request: FrontRequest, status: int, reason: str | None, headers, keep: bool) -> list[bytes]:
    out = [b"HTTP/1.1 %d %s\r\n" % (status, (reason or "").encode("latin-1", "replace") or _reason(status))]
    date = server = False
    for name, value in headers.items():
        lower = name.lower()
        if lower in ("content-length", "connection", "transfer-encoding"):
            continue
        date = date or lower == "date"
        server = server or lower == "server"
        out.append(name.encode("latin-1") + b": " + value.encode("latin-1", "surrogateescape") + b"\r\n")
    if not date:
        out.append(b"Date: " + _date() + b"\r\n")
    if not keep:
        out.append(b"Connection: close\r\n")
    elif request.http10:
        out.append(b"Connection: keep-alive\r\n")
    return out


class Whole:
    """A whole answer as the router's server writes it, built without aiohttp's web.Response (relay.py: an engine's
    small body): the head's field lines as bytes (each ending in CRLF; no Content-Length, Connection nor
    Transfer-Encoding: written here), whether they hold a Date, and the body."""

    __slots__ = ("status", "reason", "lines", "dated", "body")
    keep_alive = None  # as web.Response's: the request's own keep-alive decides

    def __init__(self, status: int, reason: str, lines: bytes, dated: bool, body: bytes):
        self.status, self.reason, self.lines, self.dated, self.body = status, reason, lines, dated, body


class FrontStream:
    """A response whose body follows in pieces: chunked to an HTTP/1.1 client; to an HTTP/1.0 one, the body
    ends with the connection."""

    def __init__(self, request: FrontRequest, status: int, reason: str | None, headers):
        self.conn = request.conn
        self.chunked = not request.http10
        self.keep_alive = self.chunked and request.keep_alive and request.complete
        self.finished = False
        head = _head(request, status, reason, headers, self.keep_alive)
        head.append(b"Transfer-Encoding: chunked\r\n\r\n" if self.chunked else b"\r\n")
        self.conn.write(b"".join(head))

    async def write(self, data: bytes) -> None:
        if not data:
            return
        self.conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self.chunked else data)
        await self.conn.drain()

    async def write_eof(self) -> None:
        if self.finished:
            return
        self.finished = True
        if self.chunked:
            self.conn.write(b"0\r\n\r\n")
        else:
            self.keep_alive = False
        await self.conn.drain()


async def open_stream(request: Any, status: int, reason: str | None, headers) -> Any:
    """A response whose body is written in pieces (write, write_eof), on either server: ours or aiohttp's."""
    if isinstance(request, FrontRequest):
        return FrontStream(request, status, reason, headers)
    response = web.StreamResponse(status=status, reason=reason, headers=headers)
    await response.prepare(request)
    return response
