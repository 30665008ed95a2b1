"""The fast path (router/fast.py): the common whole answer handled in the connections' callbacks, and every other
turn handed to the coroutine path where it stands. Its counts and metrics must be the coroutine path's exactly.

The engines here are raw asyncio servers, so that a test decides per request what the engine does: answer, close
the connection unanswered, hold the answer, or stream it."""
from __future__ import annotations

import asyncio
import json
import re

import aiohttp
import pytest

from support.router import LOOPS, metric, routed, run, serving, until

OK = "ok"
CLOSE = "close"  # the connection closed as the request came, unanswered (a kept connection the engine dropped)
HOLD = "hold"  # answered once `release` is set, unless the router closes the connection first
SSE = "sse"
ASLEEP = "asleep"  # a sleeping kaon engine's 503 (server/sleep.py)


class RawEngine:
    """An engine on a real port whose answers follow `plan`, one action per request (then OK)."""

    def __init__(self, name: str, plan: list[str] | None = None):
        self.name = name
        self.plan = list(plan or [])
        self.port = 0
        self.requests = 0
        self.connections = 0
        self.aborted = 0
        """Held requests whose connection the router closed before the answer."""
        self.release = asyncio.Event()
        self.holding = asyncio.Event()
        self._server: asyncio.Server | None = None

    async def start(self) -> RawEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                found = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
                await reader.readexactly(int(found.group(1)) if found else 0)
                self.requests += 1
                action = self.plan.pop(0) if self.plan else OK
                if action == CLOSE:
                    writer.close()
                    return
                if action == HOLD:
                    self.holding.set()
                    released = asyncio.ensure_future(self.release.wait())
                    gone = asyncio.ensure_future(reader.read(1))
                    await asyncio.wait([released, gone], return_when=asyncio.FIRST_COMPLETED)
                    released.cancel()
                    if gone.done() and not gone.result():
                        self.aborted += 1
                        return
                    gone.cancel()
                if action == ASLEEP:
                    body = b'{"error": {"message": "the engine is asleep"}}'
                    writer.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                 b"Kaon-Engine-Asleep: true\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
                elif action == SSE:
                    events = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                 b"Transfer-Encoding: chunked\r\n\r\n"
                                 + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n")
                else:
                    body = json.dumps({"backend": self.name}).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                                 % (len(body), body))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()


REQUEST = {"model": "m", "prompt": "hi", "max_tokens": 1}


async def ask(client: aiohttp.ClientSession) -> tuple[int, dict]:
    async with client.post("/v1/completions", json=REQUEST) as resp:
        return resp.status, await resp.json()


async def metrics(client: aiohttp.ClientSession) -> str:
    async with client.get("/metrics") as resp:
        return await resp.text()


@pytest.mark.parametrize("loop", LOOPS)
def test_kept_connections_answer_in_the_callbacks_with_every_count_and_metric_exact(loop):
    async def scenario():
        engine = await RawEngine("a").start()
        router = routed(engine)
        try:
            async with serving(router) as client:
                answers = [await ask(client) for _ in range(6)]
                text = await metrics(client)
        finally:
            await engine.stop()
        return router, answers, text, engine

    router, answers, text, engine = run(scenario(), loop)
    assert answers == [(200, {"backend": "a"})] * 6
    # The first request finds no kept connection (the coroutine path connects); the other five are the fast path's.
    assert router.answered_now == 5
    assert engine.connections == 1 and router.upstream.connects == 1
    assert metric(text, "kaon_router_requests_total", namespace="ns", inferenceservice="svc", code="200") == 6
    assert metric(text, "kaon_router_added_latency_seconds_count") == 6
    assert router.inflight == {}
    assert router.budget.held == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_a_held_answer_is_counted_in_flight_until_it_is_written(loop):
    async def scenario():
        engine = await RawEngine("a", [OK, HOLD]).start()
        router = routed(engine)
        try:
            async with serving(router) as client:
                assert await ask(client) == (200, {"backend": "a"})  # a kept connection from now on
                held = asyncio.ensure_future(ask(client))
                await asyncio.wait_for(engine.holding.wait(), 10)
                during = dict(router.inflight)
                engine.release.set()
                answer = await held
        finally:
            await engine.stop()
        return router, during, answer

    router, during, answer = run(scenario(), loop)
    assert answer == (200, {"backend": "a"})
    assert list(during.values()) == [1]
    assert router.answered_now == 1
    assert router.inflight == {}


@pytest.mark.parametrize("loop", LOOPS)
def test_a_kept_connection_closed_unanswered_is_resent_on_a_new_one_and_not_counted_as_a_retry(loop):
    async def scenario():
        engine = await RawEngine("a", [OK, CLOSE]).start()
        router = routed(engine)
        try:
            async with serving(router) as client:
                answers = [await ask(client), await ask(client)]
                text = await metrics(client)
        finally:
            await engine.stop()
        return router, answers, text, engine

    router, answers, text, engine = run(scenario(), loop)
    assert answers == [(200, {"backend": "a"})] * 2
    assert engine.requests == 3 and engine.connections == 2  # the second request once more, on a new connection
    assert metric(text, "kaon_router_requests_total", namespace="ns", inferenceservice="svc", code="200") == 2
    assert "kaon_router_retries_total{" not in text  # rule 1 (retry.py): not the pod's failure
    assert router.inflight == {}


async def keep_connections(router, client, *engines: RawEngine) -> None:
    """Requests until the router keeps a connection to every one of the engines (the fast path needs one to
    the pod it picks)."""
    await asyncio.gather(*(ask(client) for _ in range(8)))
    await until("kept connections to every pod",
                lambda: all(router.upstream.idle(f"http://127.0.0.1:{e.port}") > 0 for e in engines))


@pytest.mark.parametrize("loop", LOOPS)
def test_a_pod_that_fails_on_the_fast_path_is_ejected_and_the_other_answers(loop):
    async def scenario():
        a = await RawEngine("a").start()
        b = await RawEngine("b").start()
        router = routed(a, b)
        try:
            async with serving(router) as client:
                await keep_connections(router, client, a, b)
                a.plan = [CLOSE, CLOSE]  # its kept connection and then a new one: the pod is failing
                before, answers = router.answered_now, []
                while a.plan and len(answers) < 50:  # ties go at random: until `a` is picked
                    answers.append(await ask(client))
                text = await metrics(client)
        finally:
            await a.stop()
            await b.stop()
        return router, before, answers, text, a

    router, before, answers, text, a = run(scenario(), loop)
    assert not a.plan
    assert answers == [(200, {"backend": "b"})] * len(answers)
    assert router.answered_now == before + len(answers) - 1  # all but the one handed over after its failure
    assert metric(text, "kaon_router_retries_total", namespace="ns", inferenceservice="svc") == 1
    assert metric(text, "kaon_router_ejections_total", namespace="ns", inferenceservice="svc") == 1
    assert router.inflight == {}


@pytest.mark.parametrize("loop", LOOPS)
def test_an_asleep_pods_503_on_the_fast_path_goes_to_another_pod(loop):
    async def scenario():
        a = await RawEngine("a").start()
        b = await RawEngine("b").start()
        router = routed(a, b)
        try:
            async with serving(router) as client:
                await keep_connections(router, client, a, b)
                a.plan = [ASLEEP]
                answers = []
                while a.plan and len(answers) < 50:  # ties go at random: until `a` is picked
                    answers.append(await ask(client))
                text = await metrics(client)
        finally:
            await a.stop()
            await b.stop()
        return router, answers, text, a

    router, answers, text, a = run(scenario(), loop)
    assert not a.plan
    assert answers == [(200, {"backend": "b"})] * len(answers)
    assert metric(text, "kaon_router_ejections_total", namespace="ns", inferenceservice="svc") == 1
    assert "code=\"503\"" not in text
    assert router.inflight == {}


@pytest.mark.parametrize("loop", LOOPS)
def test_a_client_gone_while_the_fast_path_waits_closes_the_engines_request_and_counts_499(loop):
    async def scenario():
        engine = await RawEngine("a", [OK, HOLD]).start()
        router = routed(engine)
        try:
            async with serving(router) as client:
                assert await ask(client) == (200, {"backend": "a"})
                port = client._base_url.port
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                body = json.dumps(REQUEST).encode()
                writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await asyncio.wait_for(engine.holding.wait(), 10)
                during = dict(router.inflight)
                writer.close()
                await until("the engine's request closed", lambda: engine.aborted == 1)
                await until("the pod's count back", lambda: not router.inflight)
                text = await metrics(client)
        finally:
            await engine.stop()
        return router, during, text

    router, during, text = run(scenario(), loop)
    assert list(during.values()) == [1]
    assert metric(text, "kaon_router_requests_total", namespace="ns", inferenceservice="svc", code="499") == 1
    assert router.budget.held == 0


@pytest.mark.parametrize("loop", LOOPS)
def test_a_stream_begun_on_the_fast_path_is_relayed_by_the_coroutine_path(loop):
    async def scenario():
        engine = await RawEngine("a", [OK, SSE]).start()
        router = routed(engine)
        try:
            async with serving(router) as client:
                assert await ask(client) == (200, {"backend": "a"})
                async with client.post("/v1/completions", json={**REQUEST, "stream": True}) as resp:
                    streamed = resp.status, resp.headers["Content-Type"], await resp.read()
                after = await ask(client)
                text = await metrics(client)
        finally:
            await engine.stop()
        return router, streamed, after, text

    router, streamed, after, text = run(scenario(), loop)
    assert streamed == (200, "text/event-stream", b"data: one\n\ndata: two\n\ndata: [DONE]\n\n")
    assert after == (200, {"backend": "a"})
    assert router.answered_now == 1  # the third request; the stream was handed over
    assert metric(text, "kaon_router_requests_total", namespace="ns", inferenceservice="svc", code="200") == 3
    assert router.inflight == {}

