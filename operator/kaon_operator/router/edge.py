"""The listening socket: the router's own server (front.py) or aiohttp's, behind a cap on open
connections and a deadline on request heads, so that neither many idle clients nor slow ones hold the router's memory.

- Past --max-connections, a new connection gets a 503 with Retry-After written at once and is
  closed, without a parser or a request ever being made for it.
- --header-timeout is aiohttp's keep-alive timeout: it closes a connection that has been
  waiting that long for a whole request head, on a new connection (nothing or a part of the
  head sent) and between the requests of a kept-alive one alike. Once a request is being
  handled it no longer applies (the body has its own deadline, proxy.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import cast

from aiohttp import web

from kaon_operator.router.errors import RETRY_AFTER_S
from kaon_operator.router.front import FRONT, Front

LINGER_S = 1.0
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: " +
           RETRY_AFTER_S.encode() + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s")
REFUSAL_BODY = (b'{"error": {"message": "the router is at its limit of open connections; retry shortly", '
                b'"type": "service_unavailable", "param": null, "code": "router_overloaded"}}')


class _Refuse(asyncio.Protocol):
    """A connection past the cap: the 503, then closed."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # A stream transport, though not always an asyncio.Transport subclass (uvloop's is not: no isinstance here).
        stream = cast(asyncio.Transport, transport)
        stream.write(REFUSAL % (len(REFUSAL_BODY), REFUSAL_BODY))
        stream.close()


class ConnectionCap:
    """The protocol factory of the listening socket: the server's own while fewer than `limit`
    connections are open, a refusal past it."""

    def __init__(self, server: web.Server | Front, limit: int, refused: Callable[[], None] = lambda: None):
        self.server, self.limit, self.refused = server, limit, refused

    def __call__(self) -> asyncio.Protocol:
        if len(self.server.connections) >= self.limit:
            self.refused()
            return _Refuse()
        return self.server()


@contextlib.asynccontextmanager
async def serving(app: web.Application, host: str, port: int, *, max_connections: int, header_timeout: float,
                  refused: Callable[[], None] = lambda: None) -> AsyncIterator[int]:
    """Serve `app` on host:port (0: any free port) until the block ends; yields the port."""
    # handler_cancellation: a client that hangs up cancels its request, which closes the
    # engine connection, and the engine aborts the generation and frees its KV cache.
    # lingering_time: after answering a request whose body it did not read (a refusal), aiohttp
    # reads and drops the rest for this long so that the client sees the answer, not a reset;
    # its default (10 s) would let a stalled client hold the connection on past the refusal.
    # The router's app names its own server for the port (front.py); KAON_ROUTER_SERVER=aiohttp serves it
    # with aiohttp's instead (the server it replaced; for comparisons).
    make_front = app.get(FRONT)
    front = make_front(header_timeout) if make_front is not None and \
        os.environ.get("KAON_ROUTER_SERVER", "kaon") != "aiohttp" else None
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, keepalive_timeout=header_timeout,
                           lingering_time=LINGER_S)
    await runner.setup()
    assert runner.server is not None
    listener = await asyncio.get_running_loop().create_server(
        ConnectionCap(front or runner.server, max_connections, refused), host, port, reuse_address=True,
        backlog=1024)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        if front is not None:
            front.close()
        await runner.cleanup()
