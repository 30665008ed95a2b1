"""The router under careless or hostile clients: slow heads and bodies closed by a deadline,
connections and buffered bodies capped with a fast 503, a key checked before the body is read,
hop-by-hop headers dropped, odd model strings, and a /metrics that names no protected service.

Each case runs the real listening edge (router/edge.py) on a port, with limits small enough
that the abuse fits in a fraction of a second.
"""
from __future__ import annotations

import asyncio
import contextlib
import hashlib
import socket
import time

import pytest
from aiohttp import web
from multidict import CIMultiDict

from kaon_operator.router.admission import BodyBudget, body_size
from kaon_operator.router.errors import RouterError
from kaon_operator.router.request import engine_body, forwarded
from support.router import LOOPS, FakeEngine, metric, routed, run, serving, until
from support.tenancy import Recorder, engine_pod, isvc

COMPLETION = b'{"model": "m", "prompt": "x"}'


async def raw(port: int, data: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    return reader, writer


def head(length: int, authorization: str | None = None) -> bytes:
    auth = f"Authorization: Bearer {authorization}\r\n" if authorization else ""
    return (f"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n{auth}"
            f"Content-Length: {length}\r\n\r\n").encode()


async def closed_within(reader: asyncio.StreamReader, seconds: float) -> bytes:
    """What the router sent before closing the connection (a TimeoutError if it has not within `seconds`)."""
    return await asyncio.wait_for(reader.read(), seconds)


@contextlib.asynccontextmanager
async def router_on_port(router):
    async with serving(router) as client:
        yield client, int(str(client._base_url).rsplit(":", 1)[1])


# pure ---------------------------------------------------------------------------------


def test_body_budget_holds_at_most_its_limit_and_keeps_room_for_small_bodies():
    budget = BodyBudget(1000)
    assert budget.reserve(600) and not budget.reserve(600) and budget.reserve(400)
    budget.release(600)
    assert budget.reserve(500) and budget.held == 900
    large = BodyBudget(4 << 20)
    assert large.reserve(3 << 20) and not large.reserve(1 << 17)  # large ones fill 3/4 at most
    assert large.reserve(1 << 16) and large.held == (3 << 20) + (1 << 16)  # a small one still fits
    assert body_size(None, 4096) == 4096 and body_size(10, 4096) == 10 and body_size(10**9, 4096) == 4096


def test_fields_named_in_connection_are_hop_by_hop():
    headers = CIMultiDict(
        [("Connection", "close, X-Internal"), ("connection", " x-other "), ("X-Internal", "1"), ("X-Other", "2"),
         ("Proxy-Connection", "keep-alive"), ("TE", "trailers"), ("X-Kept", "3")])
    assert list(forwarded(headers).items()) == [("X-Kept", "3")]


# slow clients ---------------------------------------------------------------------------


def test_a_partial_head_and_a_partial_body_are_closed_by_their_deadlines():
    async def scenario():
        engine = await FakeEngine("a").start()
        async with router_on_port(routed(engine, header_timeout=0.3, body_timeout=0.3)) as (client, port):
            # Closed within 8 s: the 0.3 s deadlines at work (a busy machine may stretch them a few times),
            # not the defaults (10 s head, 30 s body), which a router ignoring its settings would apply.
            reader, _ = await raw(port, b"POST /v1/completions HTTP/1.1\r\nHost: r\r\n")  # no blank line: unfinished
            assert await closed_within(reader, 8) == b""
            reader, _ = await raw(port, b"")  # connected, sends nothing
            assert await closed_within(reader, 8) == b""
            reader, _ = await raw(port, head(len(COMPLETION)) + COMPLETION[:10])
            data = await closed_within(reader, 8)
            assert data.startswith(b"HTTP/1.1 408") and b"request_timeout" in data
        # Between requests of a kept-alive connection the head deadline applies again. A longer one
        # here: the client must read its first answer before the deadline, and a busy machine can
        # stall this process past 0.3 s (then the router closes first, and rightly).
        async with router_on_port(routed(engine, header_timeout=1.0, body_timeout=1.0)) as (client, port):
            reader, writer = await raw(port, head(len(COMPLETION)) + COMPLETION)
            first = await reader.readuntil(b'"finish_reason": "stop"}]}')
            assert first.startswith(b"HTTP/1.1 200")
            writer.write(b"POST /v1/completions HTTP/1.1\r\n")
            assert await closed_within(reader, 8) == b""
            async with client.post("/v1/completions", data=COMPLETION) as resp:  # and the router still serves
                assert resp.status == 200
        await engine.stop()

    run(scenario())


# overload -----------------------------------------------------------------------------------


@pytest.mark.parametrize("loop", LOOPS)
def test_connections_past_the_cap_get_a_fast_503_and_the_router_serves_again_after(loop):
    async def scenario():
        engine = await FakeEngine("a").start()
        router = routed(engine, max_connections=20)
        async with router_on_port(router) as (client, port):
            idle = [await raw(port, b"") for _ in range(20)]
            await asyncio.sleep(0.05)
            refused = [await raw(port, head(len(COMPLETION)) + COMPLETION) for _ in range(200)]
            for reader, _ in refused:
                data = await closed_within(reader, 8)  # answered on connect, not at the 10 s head deadline
                assert data.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in data
            for _, writer in idle:
                writer.close()
            await asyncio.sleep(0.1)
            async with client.post("/v1/completions", data=COMPLETION) as resp:
                assert resp.status == 200
        await engine.stop()
        assert router.metrics.overloaded._value.get() == 200

    run(scenario(), loop)


def test_bodies_past_the_buffer_budget_are_refused_unread():
    async def scenario():
        engine = await FakeEngine("a").start()
        # One client here: the whole budget is its share. A small body costs about 650 bytes parsed (json_cost).
        router = routed(engine, max_body_bytes=1000, max_buffered_bytes=1800, body_timeout=5, max_client_share=1.0)
        async with router_on_port(router) as (client, port):
            stalled = await raw(port, head(1000))  # holds 1000 of the 1800 bytes while it trickles
            await asyncio.sleep(0.05)
            reader, _ = await raw(port, head(1000))
            data = await closed_within(reader, 8)  # a 503 on its head (held, it would end in a 408 at 5 s)
            assert data.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in data
            async with client.post("/v1/completions", data=COMPLETION) as resp:  # a small one still fits
                assert resp.status == 200
            reader, _ = await raw(port, head(10**9))  # over --max-body-bytes: 413 on its head
            assert (await closed_within(reader, 8)).startswith(b"HTTP/1.1 413")
            stalled[1].close()
            await until("the stalled body's bytes to be given back", lambda: router.budget.held == 0)
        await engine.stop()

    run(scenario())


def test_while_every_service_needs_a_key_a_request_without_one_is_refused_on_its_head():
    async def scenario():
        engine = await Recorder().start()
        router = routed(max_body_bytes=1 << 20)
        table = router.table
        table.replace_services(None, [isvc("ns", "svc", "m", secret="keys", keys=("key-one",))])
        table.apply_pod("ADDED", engine_pod("ns", "svc", engine.port))
        async with router_on_port(router) as (client, port):
            for key in (None, "key-two"):
                reader, _ = await raw(port, head(1 << 20, key))  # announces 1 MiB, sends none of it
                data = await closed_within(reader, 8)  # on its head, not after the 30 s body deadline
                assert data.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in data
            async with client.post("/v1/completions", data=COMPLETION,
                                   headers={"Authorization": "Bearer key-one"}) as resp:
                assert resp.status == 200
        await engine.stop()

    run(scenario())


# what passes, and what shows ----------------------------------------------------------------


class HeaderEcho:
    """An engine stand-in that answers with hop-by-hop headers of its own, and keeps what it got."""

    async def start(self):
        self.seen: list[dict] = []

        async def handle(request: web.Request) -> web.Response:
            self.seen.append(dict(request.headers))
            return web.json_response({"ok": True}, headers={"Connection": "x-engine-hop", "X-Engine-Hop": "1",
                                                            "X-Engine-Kept": "1"})
        app = web.Application()
        app.router.add_post("/v1/{tail:.+}", handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self


def test_hop_by_hop_fields_named_in_connection_do_not_cross_the_router_either_way():
    async def scenario():
        engine = await HeaderEcho().start()
        router = routed()
        router.table.apply_pod("ADDED", engine_pod("ns", "svc", engine.port))
        async with serving(router) as client:
            async with client.post("/v1/completions", data=COMPLETION,
                                   headers={"Connection": "keep-alive, X-Client-Hop", "X-Client-Hop": "secret",
                                            "X-Client-Kept": "1"}) as resp:
                assert resp.status == 200
                assert "X-Engine-Hop" not in resp.headers and resp.headers["X-Engine-Kept"] == "1"
        await engine.runner.cleanup()
        (seen,) = engine.seen
        assert "X-Client-Hop" not in seen and seen["X-Client-Kept"] == "1"

    run(scenario())


def test_any_model_string_gets_an_answer_not_a_500():
    async def scenario():
        engine = await FakeEngine("a").start()
        async with serving(routed(engine)) as client:
            out = []
            for body in (b'{"model": "\\ud800", "prompt": "x"}', b'{"model": "ns/\\udfff", "prompt": "x"}',
                         b'{"model": "ns/m", "prompt": "\\ud800"}', b'{"model": "\\u0000/../m", "prompt": "x"}',
                         b'{"model": "' + b"x" * 100_000 + b'", "prompt": "x"}', b'{"model": "ns/", "prompt": "x"}'):
                async with client.post("/v1/completions", data=body) as resp:
                    out.append(resp.status)
        await engine.stop()
        assert out == [404, 404, 200, 404, 404, 404]

    run(scenario())


def test_the_open_port_metrics_name_no_protected_service():
    async def scenario():
        engine = await FakeEngine("a").start()
        router = routed(engine)
        table = router.table
        table.apply_service("ADDED", isvc("ns", "secure", "hidden", secret="keys", keys=("key-one",)))
        table.apply_pod("ADDED", engine_pod("ns", "secure", engine.port))
        async with serving(router) as client:
            for key in ("key-one", None):
                async with client.post("/v1/completions", data=b'{"model": "hidden", "prompt": "x"}',
                                       headers={"Authorization": f"Bearer {key}"} if key else {}) as resp:
                    assert resp.status == (200 if key else 404)
            async with client.get("/metrics") as resp:
                public = await resp.text()
        await engine.stop()
        assert 'inferenceservice="svc"' in public and "secure" not in public
        assert 'inferenceservice="secure"' in router.metrics.render().decode()  # the admin port's whole view
        assert hashlib.sha256(b"key-one").hexdigest() not in public

    run(scenario())


def test_a_starting_router_or_one_without_services_still_reads_and_answers_as_before():
    async def scenario():
        router = routed()
        table = router.table
        table.replace_services(None, [])
        out = []
        async with serving(router) as client:
            for synced in (False, True):
                table.synced = synced
                async with client.post("/v1/completions", data=COMPLETION) as resp:
                    out.append((resp.status, (await resp.json())["error"]["code"]))
        assert out == [(503, "router_starting"), (404, "model_not_found")]

    run(scenario())


def test_json_nested_deeper_than_the_stack_is_a_400_not_a_500():
    # Found next to the schemathesis run against the router: json.loads raised RecursionError, which
    # no handler caught, and aiohttp answered 500.
    # (Since issue 48 the depth is refused before json.loads: json_cost.Limits.depth.)
    deep = b'{"model": "m", "x": ' + b"[" * 60_000 + b"]" * 60_000 + b"}"

    async def scenario():
        engine = await FakeEngine("a").start()
        out = []
        async with serving(routed(engine)) as client:
            for body in (deep, COMPLETION):
                async with client.post("/v1/completions", data=body) as resp:
                    out.append((resp.status, (await resp.json()).get("error", {}).get("message", "")))
        await engine.stop()
        assert out[0] == (400, "the request body nests JSON arrays and objects deeper than 128 levels")
        assert out[1][0] == 200

    run(scenario())
    # A body parsed just within the stack's depth may be one level short of it when the rewrite of a
    # qualified `model` encodes it again.
    nested: list = []
    for _ in range(100_000):
        nested = [nested]
    with pytest.raises(RouterError) as refused:
        engine_body(b"", {"model": "ns/m", "x": nested}, "ns/m", "m")
    assert refused.value.status == 400


# slow readers --------------------------------------------------------------------------------


class FloodEngine:
    """An engine that streams 16 KiB events for as long as someone takes them, as a long
    generation (ignore_eos, a large max_tokens) would; records the requests cancelled under it."""

    EVENT = b"data: " + b"x" * (16 << 10) + b"\n\n"

    def __init__(self):
        self.running = 0
        self.cancelled = 0
        self.port = 0
        self.name = "flood"

    async def start(self) -> FloodEngine:
        app = web.Application()
        app.router.add_post("/v1/{tail:.+}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        self.running += 1
        try:
            while True:
                await response.write(self.EVENT)
        except (asyncio.CancelledError, ConnectionError):
            self.cancelled += 1
            raise
        finally:
            self.running -= 1


async def non_reader(port: int) -> socket.socket:
    """A client that sends a streaming request and never reads a byte of the answer (a small
    receive buffer, so that the router's own buffer fills sooner)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    body = b'{"model": "m", "prompt": "x", "stream": true, "ignore_eos": true, "max_tokens": 1000000}'
    await asyncio.get_running_loop().sock_sendall(sock, head(len(body)) + body)
    return sock


def dropped(sock: socket.socket) -> bool:
    """Whether the router has closed this connection (reset, or an end after what it had sent)."""
    sock.setblocking(True)
    sock.settimeout(1.0)
    until = time.monotonic() + 2
    try:
        while sock.recv(1 << 20):
            if time.monotonic() > until:
                return False  # still streaming to a client that reads again
        return True  # the end of the stream
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False  # still streaming: the router kept the client


def test_clients_that_stop_reading_are_dropped_within_the_write_deadline_and_their_requests_cancelled():
    async def scenario():
        engine = await FloodEngine().start()
        router = routed(engine, write_timeout=0.5)
        async with router_on_port(router) as (client, port):
            readers = [await non_reader(port) for _ in range(8)]
            await until("every stream to begin", lambda: engine.running == 8)
            await until("the stalled clients to be dropped", lambda: engine.running == 0, timeout=15)
            assert engine.cancelled == 8 and router.inflight == {}  # the engine's requests were cancelled
            stalled = [await asyncio.to_thread(dropped, sock) for sock in readers]
            assert all(stalled)
            text = (await (await client.get("/metrics")).read()).decode()
            assert metric(text, "kaon_router_stalled_clients_total", namespace="ns", inferenceservice="svc") == 8
            assert "kaon_router_ejections_total{" not in text  # the client's doing, not the pod's: none ejected
            for sock in readers:
                sock.close()
        await engine.stop()

    run(scenario())
