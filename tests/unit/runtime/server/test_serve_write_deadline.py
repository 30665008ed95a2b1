"""The engine's write deadline (server/limits.py deadline_protocol): a client that stops reading a
long stream is dropped after --write-timeout, and the stream sees a disconnect, so the generation
under it is aborted rather than held until max_tokens (and its connection forever).

A real uvicorn with kaon's protocol, serving a Starlette stream as the server's SSE responses are
(app.py _SSEResponse), to a real socket that never reads: no model needed.
"""
from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import uvicorn
from starlette.responses import StreamingResponse

from kaon_runtime.server.limits import deadline_protocol

CHUNK = b"data: " + b"x" * (16 << 10) + b"\n\n"


class Endless:
    """An ASGI app streaming CHUNKs until the client is gone; counts the streams that ended."""

    def __init__(self):
        self.running = 0
        self.ended = 0

    async def events(self):
        self.running += 1
        try:
            while True:
                yield CHUNK
                await asyncio.sleep(0)
        finally:
            self.running -= 1
            self.ended += 1

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            await StreamingResponse(self.events(), media_type="text/event-stream")(scope, receive, send)


async def polled(check, seconds: float) -> None:
    """Until `check()` holds or `seconds` passed."""
    deadline = time.monotonic() + seconds
    while True:
        if check() or time.monotonic() > deadline:
            return
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def serving(app, write_timeout: float):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", lifespan="off",
                            http=deadline_protocol(10.0, 10.0, write_timeout))
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    await polled(lambda: server.started, 10)
    try:
        yield sock.getsockname()[1]
    finally:
        server.should_exit = server.force_exit = True
        await asyncio.wait_for(task, 10)


async def non_reader(port: int) -> socket.socket:
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    client.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(client, ("127.0.0.1", port))
    await loop.sock_sendall(client, b"GET /v1/stream HTTP/1.1\r\nHost: e\r\n\r\n")
    return client


def closed(client: socket.socket) -> bool:
    client.setblocking(True)
    client.settimeout(1.0)
    until = time.monotonic() + 2
    try:
        while client.recv(1 << 20):
            if time.monotonic() > until:
                return False  # still streaming to a client that reads again
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False  # still streaming


async def scenario(write_timeout: float, wait_s: float) -> tuple[int, list[bool]]:
    """The streams ended while their clients read nothing, and which clients were dropped."""
    app = Endless()
    async with serving(app, write_timeout) as port:
        clients = [await non_reader(port) for _ in range(4)]
        await polled(lambda: app.ended == 4, wait_s)
        ended = app.ended
        gone = [await asyncio.to_thread(closed, c) for c in clients]
        for c in clients:
            c.close()
    return ended, gone


def test_a_stream_whose_client_stopped_reading_is_dropped_and_ended_after_the_write_deadline():
    start = time.monotonic()
    ended, gone = asyncio.run(scenario(write_timeout=0.5, wait_s=10))
    assert ended == 4 and all(gone)  # within the 10 s wait: the 0.5 s deadline at work, with room for a busy machine
    assert time.monotonic() - start < 30  # a liveness bound on the whole, not a claim on speed


@pytest.mark.slow
def test_without_the_deadline_such_a_stream_runs_on():
    """What the deadline guards against: uvicorn waits on a full socket buffer without end."""
    ended, gone = asyncio.run(scenario(write_timeout=1e9, wait_s=2))
    assert ended == 0 and not any(gone)
