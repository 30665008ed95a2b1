"""The router's client to the engine pods: pooled keep-alive HTTP/1.1 on asyncio protocols.

aiohttp's ClientSession was about a third of the router's CPU per request (py-spy; bench/router.py):
a request object, a connector, a timer and a task per request, all for one POST of a body already in
memory. This does only that: one write of the request head and body on a pooled connection, the
response parsed by httptools (llhttp, the parser uvicorn uses: chunked and content-length bodies,
keep-alive), and the body handed on as it arrives, each piece as the parser gave it (no copy but
the join of what a slow reader let pile up).

A connection goes back to its pod's pool only after a whole response on a keep-alive connection,
and is not used after UPSTREAM_KEEPALIVE_S idle (the engine closes at 5 s). A response released
before its end closes its connection: the engine sees the client gone and aborts the request.
A reused connection that fails before any byte of the answer came (the engine closed it as the
request went out) is tried once more on a new connection to the same pod; any other failure is
the caller's (UpstreamError: the router retries another pod, or ends a begun response).

Reading is paused while more than HIGH_WATER bytes wait for a reader (a client slower than its
engine), so a slow client holds at most that much of the router's memory per stream.

Over 300 lines for a stated reason: the pool, the protocol and the body reader share one connection's
state (the parser's callbacks feed the reader, the reader decides when the connection goes back to the
pool); split apart, each would reach into the other's fields.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict

from kaon_operator.router import retry

UPSTREAM_KEEPALIVE_S = 4.0
"""The engine (uvicorn) closes idle keep-alive connections after 5 s. A request sent on a connection it
is closing fails after it went out; stay under (and see the one retry on a fresh connection: retry.py, rule 1)."""
HIGH_WATER = 1 << 18
"""Unread response bytes per connection above which the engine's socket is not read."""
MAX_IDLE_PER_POD = 256
MAX_ADDRESSES = 4096
"""Parsed pod URLs kept (pods come and go: past this the cache starts afresh)."""
MAX_STARTS = 64
"""Request lines kept per pod URL."""
MAX_REASONS = 256
_REASONS: dict[bytes, str] = {}
"""Reason phrases as an engine sent them -> str."""
MAX_MEDIA_TYPES = 256
_MEDIA_TYPES: dict[bytes, str] = {}
"""An engine's Content-Type field values -> their media type, lower-case (Response.content_type)."""


class UpstreamError(Exception):
    """The engine's connection failed: refused, reset, closed, or a response that is not HTTP."""


class ConnectFailed(UpstreamError):
    """No connection could be made (refused, unreachable, or not within the connect timeout)."""


class _Address:
    __slots__ = ("host", "port", "host_header", "_starts")

    def __init__(self, url: str):
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or 80
        self.host_header = parts.netloc.encode("ascii")
        self._starts: dict[tuple[str, str], bytes] = {}

    def request_line(self, method: str, path: str) -> bytes:
        """The request line and Host field, as bytes: made once per method and path (most requests share a few; the
        query string is the client's, so the kept ones are few and short)."""
        start = self._starts.get((method, path))
        if start is None:
            line = f"{method} {path} HTTP/1.1\r\nHost: ".encode("utf-8", "surrogateescape")
            start = line + self.host_header + b"\r\n"
            if len(self._starts) < MAX_STARTS and len(path) <= 256:
                self._starts[(method, path)] = start
        return start


class Response:
    """One engine response: status and headers once the head is in; the body through `readany`
    (b"" at its end) or `read`. `release()` (or leaving `async with`) hands the connection back,
    or closes it when the body was not read to its end."""

    __slots__ = ("status", "reason", "raw_headers", "_headers", "_chunks", "_buffered", "_waiter", "complete", "_error",
                 "_conn", "keep_alive", "until_close", "released", "_type", "_length", "_coding")

    def __init__(self, conn: _Connection):
        self.status = 0
        self.reason = ""
        self.raw_headers: list[tuple[bytes, bytes]] = []
        """The fields as they came: (name, value) bytes."""
        self._headers: CIMultiDict[str] | None = None
        self._chunks: list[bytes] = []  # (taken whole each time, never from the front: no deque's 64-slot block)
        self._buffered = 0
        self._waiter: asyncio.Future[None] | None = None
        self.complete = False
        self._error: UpstreamError | None = None
        self._conn = conn
        self.keep_alive = False
        self.until_close = False
        """The body ends when the engine closes the connection (no Content-Length, not chunked)."""
        self.released = False
        # The three fields the relay and the framing read, noted as they are parsed: no scan of the headers.
        self._type: bytes | None = None
        self._length: bytes | None = None
        self._coding: bytes | None = None

    # what the relay reads ------------------------------------------------------------

    @property
    def headers(self) -> CIMultiDict[str]:
        if self._headers is None:  # built once, when asked (the asleep check asks for one field)
            self._headers = CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers)
        return self._headers

    def header(self, name: bytes) -> str | None:
        """One field by its lower-case name, without building the headers."""
        for k, v in self.raw_headers:
            if k.lower() == name:
                return v.decode("latin-1")
        return None

    @property
    def content_type(self) -> str:
        value = self._type
        if not value:
            return "application/octet-stream"
        found = _MEDIA_TYPES.get(value)  # an engine sends a few Content-Types: each read once
        if found is None:
            found = value.split(b";", 1)[0].strip().lower().decode("latin-1")
            if len(_MEDIA_TYPES) < MAX_MEDIA_TYPES:
                _MEDIA_TYPES[value] = found
        return found

    @property
    def content_length(self) -> int | None:
        value = self._length
        if value is None:
            return None
        if value.isdigit():  # (int() takes the ASCII digits as they are)
            return int(value)
        return int(value) if (value := value.strip()).isdigit() else None

    @property
    def content(self) -> Response:
        """The body as a stream (pump.Pump reads `readany()` from it)."""
        return self

    async def readany(self) -> bytes:
        """What has arrived of the body since the last call (waiting for some); b"" at its end."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._take()

    def body_now(self) -> bytes | None:
        """The whole body when all of it is in (complete, not failed): what `read` would return at once, without a
        coroutine; None otherwise (read it)."""
        if not self.complete or self._error is not None:
            return None
        return self._take()

    def _take(self) -> bytes:
        """What has arrived of the body (b"" if nothing), taken; the connection read again if it had been paused."""
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered > HIGH_WATER:
            self._conn.resume()
        self._buffered = 0
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self.readany():
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        if self.released:
            return
        self.released = True
        self._conn.done(self)

    async def __aenter__(self) -> Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()

    # what the connection feeds -------------------------------------------------------

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, error: UpstreamError) -> None:
        self._error = error
        self._wake()


class _Connection(asyncio.Protocol):
    """One TCP connection to a pod; httptools calls the on_* methods as it parses."""

    def __init__(self, pool: Pool, url: str):
        self.pool, self.url = pool, url
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.head: Any = None
        """What waits for the response head: Pool.request's future, or a fast exchange (fast.py) offering the part of a
        future used here (done, set_result, set_exception). Any: mypyc would check a Future's type on assignment."""
        self.now: Any = None
        """A fast exchange (fast.py), told once the read that brought its response head is parsed (`headed`)."""
        self.closed = False
        self.received = False  # any byte of the current response
        self.idle_since = 0.0
        self.paused = False
        self.uses = 0
        self.head_due: float | None = None
        """When the response head in wait is due (the event loop's clock); None when none is awaited."""
        self.head_timer: asyncio.TimerHandle | None = None
        """One timer per connection, kept armed across its requests and looking again when it fires (expect_head_by):
        no timer made and cancelled per request."""

    # asyncio's side --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # a TCP connection's: an asyncio.Transport

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._failed(UpstreamError(f"the engine's response is not valid HTTP/1.1 ({exc})"))
            self.close()
        except httptools.HttpParserUpgrade:
            self._failed(UpstreamError("the engine's response upgraded the connection"))
            self.close()
        now = self.now
        if now is not None and self.head is None:  # its head came with this read (or it failed: `headed` looks), parsed
            self.now = None
            now.headed()

    def eof_received(self) -> bool | None:
        return None  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.head_due = None
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None
        self.pool.forget(self)
        response = self.response
        if response is not None and not response.complete and response._error is None:
            if self.head is None and response.until_close:
                response._finish()  # a body without a length ends with the connection
            else:
                reason = str(exc) if exc else "the engine closed the connection"
                self._failed(UpstreamError(reason if self.head is not None else
                                           f"the response broke off: {reason}"))

    # httptools' side --------------------------------------------------------------------

    def on_status(self, reason: bytes) -> None:
        assert self.response is not None
        text = _REASONS.get(reason)  # the same few: kept, so that the front's status lines are found by a kept hash
        if text is None:
            text = reason.decode("latin-1")
            if len(_REASONS) < MAX_REASONS and len(reason) <= 64:
                _REASONS[reason] = text
        self.response.reason += text

    def on_header(self, name: bytes, value: bytes) -> None:
        response = self.response
        assert response is not None
        response.raw_headers.append((name, value))
        if len(name) in (12, 14, 17):  # the length of the three names below: most fields skip the compare
            lower = name.lower()
            if lower == b"content-type":
                response._type = value
            elif lower == b"content-length":
                response._length = value
            elif lower == b"transfer-encoding":
                response._coding = value

    def on_headers_complete(self) -> None:
        response = self.response
        assert response is not None
        response.status = self.parser.get_status_code()
        if response.status < 200:  # an interim answer (100 Continue): the real one follows
            return
        response.keep_alive = self.parser.should_keep_alive()
        if response.status not in (204, 304):
            response.until_close = response._length is None and b"chunked" not in (response._coding or b"").lower()
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_result(response)

    def on_body(self, data: bytes) -> None:
        if self.response is not None and self.head is None:
            self.response._body(data)

    def on_message_complete(self) -> None:
        response = self.response
        assert response is not None
        if response.status < 200:  # the interim answer's end: parse the next head afresh
            self.response = Response(self)
            return
        response._finish()
        if response.released:
            self.done(response)

    # the pool's side ----------------------------------------------------------------------

    def send(self, data: bytes, head: Any) -> None:
        assert self.transport is not None
        self.response, self.head, self.received = Response(self), head, False
        self.uses += 1
        self.transport.write(data)

    def expect_head_by(self, deadline: float, loop: asyncio.AbstractEventLoop) -> None:
        """The response head to the request just sent is due by `deadline`: its future fails with TimeoutError then."""
        self.head_due = deadline
        timer = self.head_timer
        if timer is None or timer.when() > deadline:  # (the same timeout for every request: rarely the case)
            if timer is not None:
                timer.cancel()
            self.head_timer = loop.call_at(deadline, self._head_overdue, loop)

    def _head_overdue(self, loop: asyncio.AbstractEventLoop) -> None:
        self.head_timer = None
        if self.head is None or self.head_due is None:
            return  # the head came (or the exchange ended): the next request arms it again
        if loop.time() >= self.head_due:
            _expire(self.head)
        else:  # a later request's deadline
            self.head_timer = loop.call_at(self.head_due, self._head_overdue, loop)

    def done(self, response: Response) -> None:
        """The response was released: keep the connection for the next request if it is whole."""
        if response is not self.response:
            return
        if not response.complete:
            self.close()  # the engine sees the client gone and aborts the request
            return
        self.response = None
        if response.keep_alive and not self.closed and response._error is None:
            self.pool.put(self)
        else:
            self.close()

    def pause(self) -> None:
        if not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.close()
        self.closed = True

    def _failed(self, error: UpstreamError) -> None:
        head, self.head = self.head, None
        if head is not None and not head.done():
            head.set_exception(error)
        elif self.response is not None:
            self.response._fail(error)


class Pool:
    """Keep-alive connections per pod (its URL), newest first."""

    def __init__(self, connect_timeout: float, keepalive: float = UPSTREAM_KEEPALIVE_S,
                 max_idle: int = MAX_IDLE_PER_POD):
        self.connect_timeout, self.keepalive, self.max_idle = connect_timeout, keepalive, max_idle
        self._idle: dict[str, list[_Connection]] = {}
        self._addresses: dict[str, _Address] = {}
        self._open: set[_Connection] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        """The loop of the requests (asyncio.get_running_loop() asks the system for the process id on each call)."""
        self.connects = 0
        """New connections made (the tests' and the bench's view of reuse)."""

    def loop_time(self) -> float:
        """The event loop's clock (the keep-alive's)."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        return loop.time()

    def has_idle(self, url: str, now: float) -> bool:
        """Whether `_take` would return a kept connection to `url` at `now`: the newest is open and within the
        keep-alive (they are kept in the order they came back, so the others are older still)."""
        idle = self._idle.get(url)
        if not idle:
            return False
        newest = idle[-1]
        return not newest.closed and now - newest.idle_since < self.keepalive

    def send_now(self, url: str, method: str, path: str, fields: Iterable[bytes], body: bytes, timeout: float,
                 exchange: Any) -> tuple[bytes, float]:
        """Pool.request's first step without a coroutine (fast.py): the request on a kept connection (has_idle said
        there is one, in the same callback); `exchange` is told of the head (set_result, then headed once the read is
        parsed) or of the failure (set_exception: the caller goes on with `resend`). The bytes sent and the head's
        deadline, for that."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeout
        data = _encode(self._address(url).request_line(method, path), fields, body)
        conn = self._take(url, now)
        assert conn is not None  # has_idle, in the same callback
        exchange.conn = conn
        conn.send(data, exchange)
        conn.now = exchange
        conn.expect_head_by(deadline, loop)
        return data, deadline

    async def resend(self, url: str, data: bytes, deadline: float) -> Response:
        """The same request once more, on a new connection to the same pod (retry.py, rule 1), after the kept one of
        the fast path (send_now) failed unanswered."""
        loop = self._loop or asyncio.get_running_loop()
        return await self._exchange(url, self._address(url), data, deadline, loop, None, False)

    def _address(self, url: str) -> _Address:
        address = self._addresses.get(url)
        if address is None:
            if len(self._addresses) >= MAX_ADDRESSES:
                self._addresses.clear()
            address = self._addresses[url] = _Address(url)
        return address

    async def request(self, url: str, method: str, path: str, fields: Iterable[bytes], body: bytes,
                      timeout: float) -> Response:
        """Send the request to the pod at `url` and return its response once the head is in. `fields`:
        the head's lines (b"Name: value\r\n", request.upstream_fields) past Host and Content-Length.
        TimeoutError when no head came within `timeout` seconds of the call (connecting included),
        ConnectFailed when no connection could be made, UpstreamError when it failed after."""
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
        now = loop.time()
        deadline = now + timeout
        address = self._address(url)
        data = _encode(address.request_line(method, path), fields, body)
        conn = self._take(url, now)
        return await self._exchange(url, address, data, deadline, loop, conn, conn is not None)

    async def _exchange(self, url: str, address: _Address, data: bytes, deadline: float,
                        loop: asyncio.AbstractEventLoop, conn: _Connection | None, reused: bool) -> Response:
        """Send `data` on `conn` (None: a new connection) and wait for the head; once more on a new connection when a
        reused one failed unanswered (retry.py, rule 1)."""
        while True:  # a reused connection first, if one is idle; a new one once when it fails unanswered (retry.py)
            if conn is None:
                conn = await self._connect(url, address, deadline, loop)
            head: asyncio.Future[Response] = loop.create_future()
            conn.send(data, head)
            conn.expect_head_by(deadline, loop)
            try:
                return await head
            except UpstreamError:
                conn.close()
                if not retry.resend_on_new_connection(reused=reused, answered=conn.received):
                    raise
            except BaseException:  # a timeout, or the client gone (cancelled): the engine sees a close
                conn.close()
                raise
            finally:
                conn.head_due = None
            conn, reused = None, False

    def put(self, conn: _Connection) -> None:
        idle = self._idle.setdefault(conn.url, [])
        if len(idle) >= self.max_idle:
            conn.close()
            return
        conn.idle_since = (self._loop or asyncio.get_running_loop()).time()
        idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        self._open.discard(conn)
        idle = self._idle.get(conn.url)
        if idle and conn in idle:
            idle.remove(conn)
            if not idle:
                del self._idle[conn.url]

    def close(self) -> None:
        for conn in list(self._open):
            conn.close()
        self._idle.clear()

    def idle(self, url: str) -> int:
        return len(self._idle.get(url, ()))

    def _take(self, url: str, now: float) -> _Connection | None:
        idle = self._idle.get(url)
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < self.keepalive:
                return conn
            conn.close()
        if idle is not None:
            del self._idle[url]  # none left: a pod that is gone leaves no entry behind
        return None

    async def _connect(self, url: str, address: _Address, deadline: float,
                       loop: asyncio.AbstractEventLoop) -> _Connection:
        limit = min(self.connect_timeout, deadline - loop.time())
        try:
            async with asyncio.timeout(max(0.0, limit)):
                _, conn = await loop.create_connection(lambda: _Connection(self, url), address.host, address.port)
        except TimeoutError:
            if limit < self.connect_timeout:
                raise  # the caller's deadline, not the connect timeout
            raise ConnectFailed(f"no connection within {self.connect_timeout:g}s") from None
        except OSError as exc:
            raise ConnectFailed(exc.strerror or str(exc)) from None
        self.connects += 1
        self._open.add(conn)
        return conn


def _expire(head: asyncio.Future[Any]) -> None:
    if not head.done():
        head.set_exception(TimeoutError())


def _encode(start: bytes, fields: Iterable[bytes], body: bytes) -> bytes:
    """The request head and body as one buffer: one send. `start`: the request line and Host (_Address.request_line).
    The fields come from the router's parser (httptools) or aiohttp's, which refuse CR and LF in them."""
    return b"".join((start, content_length_line(len(body)), *fields, b"\r\n", body))


_LENGTH_LINES: dict[int, bytes] = {}
MAX_LENGTH_LINES = 4096


def content_length_line(size: int) -> bytes:
    """`Content-Length: <size>` and its CRLF, made once per size (bounded: most bodies are of a few sizes)."""
    line = _LENGTH_LINES.get(size)
    if line is None:
        line = b"Content-Length: %d\r\n" % size
        if len(_LENGTH_LINES) < MAX_LENGTH_LINES:
            _LENGTH_LINES[size] = line
    return line
