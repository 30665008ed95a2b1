"""The router's own HTTP/1.1 server (router/front.py) on the wire: requests split at every byte, chunked
bodies, pipelining, keep-alive and HTTP/1.0, 100-continue, and malformed or oversized requests, each a
clear 4xx in OpenAI's error shape and a closed connection: never a hang, a 5xx or a stack trace.

Each case runs the real listening edge (router/edge.py) on a port before a fake engine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random

import pytest

from kaon_operator.router import front
from support.router import FakeEngine, routed, run, serving

BODY = b'{"model": "m", "prompt": "x"}'
POST = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))
CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nTransfer-Encoding: chunked\r\n\r\n"
           b"5\r\n" + BODY[:5] + b"\r\n" + b"%x\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\n\r\n")
ANSWER_END = b'"finish_reason": "stop"}]}'
LAST = b"GET /health HTTP/1.1\r\nConnection: close\r\n\r\n"  # the router closes after it


@contextlib.asynccontextmanager
async def router_port(**config):
    engine = await FakeEngine("a").start()
    router = routed(engine, **config)
    async with serving(router) as client:
        yield int(str(client._base_url).rsplit(":", 1)[1]), engine
    await engine.stop()


async def exchange(port: int, pieces: list[bytes], seconds: float = 5.0) -> bytes:
    """Send `pieces` one write each (a pause between them, so that each arrives alone), half-close, and
    read what comes back until the router closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for piece in pieces:
        writer.write(piece)
        await writer.drain()
        if len(pieces) > 1:
            await asyncio.sleep(0)
    try:
        return await asyncio.wait_for(reader.read(), seconds)
    finally:
        writer.close()


def answers(data: bytes) -> list[tuple[int, bytes]]:
    """The (status, body) of each response in `data`, whole bodies by Content-Length or chunked."""
    out = []
    while data:
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(b":") for line in lines[1:])}
        if b"content-length" in fields:
            n = int(fields[b"content-length"])
            body, data = data[:n], data[n:]
        elif fields.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                n = int(size, 16)
                body, data = body + data[:n], data[n + 2:]
                if n == 0:
                    break
        else:
            body, data = data, b""
        out.append((status, body))
    return out


def test_a_request_split_at_every_byte_is_answered_whole():
    async def scenario():
        async with router_port() as (port, engine):
            for request in (POST, CHUNKED):
                for cut in range(1, len(request)):
                    data = await exchange(port, [request[:cut], request[cut:]] + [LAST])
                    got = answers(data)
                    assert [s for s, _ in got] == [200, 200], (request[:cut], data)
                    assert got[0][1].endswith(ANSWER_END)
            assert engine.quick == len(POST) - 1 + len(CHUNKED) - 1
            # every byte its own write
            got = answers(await exchange(port, [bytes([b]) for b in CHUNKED] + [LAST]))
            assert [s for s, _ in got] == [200, 200]

    run(scenario())


def test_pipelined_requests_are_answered_in_order_and_a_close_ends_the_connection():
    async def scenario():
        async with router_port() as (port, engine):
            data = await exchange(port, [POST + CHUNKED + b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n" +
                                         b"GET /nowhere HTTP/1.1\r\n\r\n" + POST])
            got = answers(data)
            assert [s for s, _ in got] == [200, 200, 200, 404]  # the 404 closes: the last POST is not read
            assert json.loads(got[3][1])["error"]["code"] == "unknown_url"
            assert engine.quick == 2
            # Connection: close, and HTTP/1.0 without keep-alive, close after their answer
            closing = POST.replace(b"Host: r\r\n", b"Host: r\r\nConnection: close\r\n")
            assert [s for s, _ in answers(await exchange(port, [closing + POST]))] == [200]
            old = POST.replace(b"HTTP/1.1", b"HTTP/1.0")
            data = await exchange(port, [old + POST])
            assert [s for s, _ in answers(data)] == [200] and b"Connection: close" in data

    run(scenario())


def test_each_pipelined_request_is_answered_in_its_own_http_version():
    """The version is read from the request line at the start of a read when it is plainly there (front.py: no
    get_http_version, ~0.7 us), else from the parser: a kept-alive HTTP/1.0 request behind an HTTP/1.1 one in the same
    read, or split from its line, is still answered as HTTP/1.0 (its Connection: keep-alive said back, its stream not
    chunked), and an HTTP/1.1 one behind an HTTP/1.0 one as HTTP/1.1."""
    old = POST.replace(b"HTTP/1.1", b"HTTP/1.0").replace(b"Host: r\r\n", b"Host: r\r\nConnection: keep-alive\r\n")
    health = b"GET /health HTTP/1.1\r\nHost: r\r\n\r\n"
    kept = b"Connection: keep-alive\r\n"

    def heads(data: bytes) -> list[bytes]:
        return [part.partition(b"\r\n\r\n")[0] for part in data.split(b"HTTP/1.1 ")[1:]]

    async def scenario():
        async with router_port() as (port, _):
            for pieces, expected in (([POST + old + LAST], [False, True, False]),
                                     ([old + POST + LAST], [True, False, False]),
                                     ([old[:3], old[3:] + health + LAST], [True, False, False]),
                                     ([health + old + LAST], [False, True, False])):
                data = await exchange(port, pieces)
                assert [s for s, _ in answers(data)] == [200, 200, 200], data
                assert [kept in h for h in heads(data)] == expected, (pieces, data)

    run(scenario())


def test_expect_100_continue_is_answered_before_the_body_is_sent():
    async def scenario():
        async with router_port() as (port, _):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(POST[:-len(BODY)].replace(b"Host: r\r\n", b"Host: r\r\nExpect: 100-continue\r\n"))
            assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
            writer.write(BODY)
            assert (await asyncio.wait_for(reader.readuntil(b"\r\n"), 5)).startswith(b"HTTP/1.1 200")
            writer.close()

    run(scenario())


MALFORMED = [
    (b"GARBAGE\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/9.9\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcdef", 400),
    (b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdefgh\r\n0\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nX\x00Y: 1\r\n\r\n", 400),
    (b"POST /v1/completions HTTP/1.1\r\nBad Name: 1\r\n\r\n", 400),
    (b"POST /%zz HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 404),
    (b"POST /" + b"a" * 9000 + b" HTTP/1.1\r\n\r\n", 414),
    (b"POST /v1/completions HTTP/1.1\r\nX-Big: " + b"a" * 9000 + b"\r\n\r\n", 431),
    (b"POST /v1/completions HTTP/1.1\r\n" + b"".join(b"X-%d: 1\r\n" % i for i in range(200)) + b"\r\n", 431),
    (b"POST /v1/completions HTTP/1.1\r\n" + b"X-Many: 1\r\n" * 3 + b"X-Long: " + b"b" * 80000, 431),
]


def test_malformed_and_oversized_requests_get_a_clear_4xx_and_are_closed(caplog):
    async def scenario():
        async with router_port(body_timeout=1.0) as (port, engine):
            for request, status in MALFORMED:
                data = await exchange(port, [request], seconds=8)
                got = answers(data)
                assert [s for s, _ in got] == [status], (request[:80], data[:300])
                error = json.loads(got[0][1])["error"]
                assert error["type"] == "invalid_request_error" and error["message"], error
            # split at every byte, the cases fail the same way
            for request, status in MALFORMED[:9]:
                for cut in range(1, len(request), 3):
                    got = answers(await exchange(port, [request[:cut], request[cut:]], seconds=8))
                    assert [s for s, _ in got] == [status], (request, cut)
            assert engine.quick == 0

    with caplog.at_level(logging.ERROR, logger="kaon.router"):
        run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_random_damage_to_a_request_never_gets_a_5xx_a_hang_or_a_stack_trace(caplog):
    rng = random.Random(51)

    def damaged() -> bytes:
        data = bytearray(rng.choice([POST, CHUNKED]))
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(data))
            what = rng.randrange(4)
            if what == 0:
                data[i] = rng.randrange(256)
            elif what == 1:
                del data[i:i + rng.randint(1, 8)]
            elif what == 2:
                data[i:i] = rng.choice([b"\r\n", b"\n", b":", b" ", b"\x00", b"0", b"\r\n\r\n", b"%"])
            else:
                data[i:i] = data[rng.randrange(len(data)):][:rng.randint(1, 40)]
        return bytes(data)

    async def one(port: int, request: bytes) -> None:
        data = await exchange(port, [request], seconds=8)  # a hang fails here (the head's default deadline is 10 s)
        if data:  # nothing at all: a head that never ended, closed by --header-timeout
            assert data.startswith(b"HTTP/1.1 "), (request, data)
            assert all(s < 500 for s, _ in answers(data)), (request, data)

    async def scenario():
        async with router_port(header_timeout=0.3, body_timeout=0.3) as (port, _):
            await asyncio.gather(*(one(port, damaged()) for _ in range(200)))

    with caplog.at_level(logging.ERROR, logger="kaon.router"):
        run(scenario())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_the_router_app_names_its_own_server_for_the_port():
    engine = FakeEngine("a")
    assert front.FRONT in routed(engine).app()


def test_the_front_answers_on_uvloops_event_loop():
    """kaon-router may run on uvloop (bench/router.py --loops uvloop; the `uvloop` extra), whose transports are not
    asyncio.Transport subclasses: a plain answer, a pipelined pair, a stream passed on whole, and a client that hangs
    up mid-stream aborting the engine's request, all on uvloop's loop."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario():
        assert type(asyncio.get_running_loop()).__module__.startswith("uvloop")
        async with router_port() as (port, engine):
            assert [s for s, _ in answers(await exchange(port, [POST + CHUNKED + LAST]))] == [200, 200, 200]
            assert engine.quick == 2
            stream = json.dumps({"model": "m", "prompt": "long", "stream": True}).encode()
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(stream), stream))
            head = await asyncio.wait_for(reader.readuntil(b"data: started\n\n"), 5)
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
            writer.close()  # the client hangs up: the engine's request is cancelled
            deadline = asyncio.get_running_loop().time() + 5
            while not engine.aborted:
                assert asyncio.get_running_loop().time() < deadline, "the engine's request was not aborted"
                await asyncio.sleep(0.01)

    uvloop.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_a_body_malformed_part_way_is_answered_and_the_rest_of_the_upload_dropped_not_reset(loop):
    """A chunked body that turns malformed while more of it is on its way: the client gets its 400, then the end
    of the connection, never a reset for the bytes it was still sending (front._next lingers, reading and
    dropping them). uvloop's loop closed before reading them more often than asyncio's did."""
    new_loop = pytest.importorskip("uvloop").new_event_loop if loop == "uvloop" else asyncio.new_event_loop
    malformed = b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nabcdefgh\r\n"

    async def scenario():
        async with router_port() as (port, engine):
            for _ in range(3):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(malformed)
                for _ in range(16):  # the rest of the upload, still coming after the answer went out
                    writer.write(b"x" * (16 << 10))
                    await writer.drain()
                    await asyncio.sleep(0.005)
                data = await asyncio.wait_for(reader.read(), 10)  # a reset raises here
                writer.close()
                assert [s for s, _ in answers(data)] == [400], data[:200]
            assert engine.quick == 0

    with asyncio.Runner(loop_factory=new_loop) as runner:
        runner.run(asyncio.wait_for(scenario(), 30))


def test_a_kept_alive_connections_head_deadline_starts_again_after_each_answer():
    """One timer per connection looks again when it fires (front._await_head): requests each sent within
    --header-timeout of the last answer are all answered, though together they take longer than it."""
    async def scenario():
        async with router_port(header_timeout=3.0) as (port, engine):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for i in range(3):
                writer.write(POST)
                assert (await asyncio.wait_for(reader.readuntil(ANSWER_END), 10)).startswith(b"HTTP/1.1 200")
                if i < 2:
                    # 3.2 s in all, past the first deadline; each gap 1.4 s within it (room for a busy machine)
                    await asyncio.sleep(1.6)
            writer.write(LAST)
            assert [s for s, _ in answers(await asyncio.wait_for(reader.read(), 5))] == [200]
            writer.close()
            assert engine.quick == 3

    run(scenario())


class _Sink:
    """A client connection's transport that keeps what the router writes."""

    def __init__(self):
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 40000) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def can_write_eof(self) -> bool:
        return False


def test_the_fields_the_router_reads_come_from_the_head_never_from_a_chunked_bodys_trailer():
    """Authorization (the first), Content-Length and Expect are noted as the head is parsed; a trailer's fields
    (after a chunked body, parsed before the handler runs) are kept with the others but change none of them."""
    seen = []

    async def handler(request: front.FrontRequest):
        seen.append((request.authorization, request.content_length, request.expect_continue, await request.read()))
        return front.Whole(200, "OK", b"", False, b"{}")

    async def scenario():
        server = front.Front({("POST", "/v1/completions"): handler}, handler, 1 << 20, 60.0)
        for head, trailer in ((b"", b"Authorization: Bearer trailer\r\nExpect: 100-continue\r\n"),
                              (b"Authorization: Bearer first\r\nAuthorization: Bearer second\r\nContent-Length: 5\r\n",
                               b"Authorization: Bearer trailer\r\n")):
            conn = server()
            sink = _Sink()
            conn.connection_made(sink)
            chunked = b"Transfer-Encoding: chunked\r\n" if not head else b""
            body = b"5\r\nhello\r\n0\r\n" + trailer + b"\r\n" if chunked else b"hello"
            conn.data_received(b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n" + chunked + head + b"\r\n" + body)
            for _ in range(100):
                await asyncio.sleep(0)
                if sink.written:
                    break
            assert sink.written.startswith(b"HTTP/1.1 200 OK\r\n"), sink.written
            conn.close()

    run(scenario())
    assert seen == [(None, None, False, b"hello"), ("Bearer first", 5, False, b"hello")]


def test_request_targets_read_the_same_kept_or_not_and_the_kept_ones_stay_bounded(monkeypatch):
    """front keeps each request target's path and query as read (clients send the same few): read again or kept, the
    same answer, escapes and dot segments as yarl reads them, a malformed one refused every time; and no more kept
    than MAX_TARGETS however many targets clients invent, nor any longer than MAX_KEPT_TARGET."""
    monkeypatch.setattr(front, "_TARGETS", {})
    cases = {b"/v1/completions": ("/v1/completions", ""), b"/v1/models?x=1&y": ("/v1/models", "x=1&y"),
             b"/v1/%63ompletions": ("/v1/completions", ""), b"/v1/./models": ("/v1/./models", ""),
             b"http://h/v1/models?a": ("/v1/models", "a")}
    for raw, expected in cases.items():
        for _ in range(2):  # read, then kept
            got = front._TARGETS.get(raw) or front._target(raw)
            front._TARGETS.setdefault(raw, got)
            assert got == expected, raw
    with pytest.raises(front.errors.RouterError):
        front._target(b"http://[::1/x")

    async def go():
        port, _ = await router_context.__aenter__()
        try:
            for i in range(front.MAX_TARGETS + 20):
                await exchange_one(port, b"GET /health?n=%d HTTP/1.1\r\nConnection: close\r\n\r\n" % i)
            await exchange_one(port, b"GET /health?" + b"x" * front.MAX_KEPT_TARGET + b" HTTP/1.1\r\n"
                               b"Connection: close\r\n\r\n")
        finally:
            await router_context.__aexit__(None, None, None)

    router_context = router_port()
    run(go())
    assert len(front._TARGETS) == front.MAX_TARGETS
    assert all(len(raw) <= front.MAX_KEPT_TARGET for raw in front._TARGETS)


async def exchange_one(port: int, request: bytes) -> None:
    status, _ = answers(await exchange(port, [request]))[0]
    assert status == 200
