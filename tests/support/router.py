"""The router's test kit: fake engines, pods and services, a router serving on a port, polling."""
from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import random
import threading
import time

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from e2e.control_plane import free_port
from kaon_operator import api
from kaon_operator.labels import service_labels
from kaon_operator.router import edge
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.event_loop import loop_factory
from kaon_operator.router.proxy import Router

NS = "ns"


def pod(name: str, service: str = "svc", *, port: int = 8000, ip: str | None = "127.0.0.1", ready: bool = True,
        deleting: bool = False, namespace: str = NS, labels: dict | None = None) -> dict:
    meta = {"name": name, "namespace": namespace, "labels": labels or service_labels(service)}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    status = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    if ip:
        status["podIP"] = ip
    return {"metadata": meta, "status": status,
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]}}


def isvc(name: str, served_name: str | None = None, *, namespace: str = NS, created: str = "2026-01-01T00:00:00Z"):
    model = {"uri": "builtin://smollm2-135m-instruct", **({"servedName": served_name} if served_name else {})}
    return {"apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {"model": model}}


class FakeEngine:
    """An engine stand-in on a real port. The request body says what to do:
    `prompt: "long"` streams one event, then holds until `release` is set; `prompt: "gated"`
    streams `events`, each after its gate opens; `prompt: "broken"` dies after one event;
    `fake: {status, body, headers}` answers
    exactly that; anything else is a quick JSON completion naming this engine."""

    def __init__(self, name: str, events: list[bytes] = ()):
        self.name = name
        self.longs = 0
        self.quick = 0
        self.release = asyncio.Event()
        self.events = list(events)
        self.gates = [asyncio.Event() for _ in self.events]
        self.finished = False
        self.aborted = False
        self.asleep = False  # answers every request as a sleeping kaon engine does (server/sleep.py)
        self.port = 0
        self._runner: web.AppRunner | None = None

    async def start(self) -> FakeEngine:
        app = web.Application()
        app.router.add_post("/v1/{tail:.+}", self._handle)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if self.asleep:
            error = {"message": "the engine is asleep", "type": "service_unavailable", "param": None,
                     "code": "engine_asleep"}
            return web.json_response({"error": error}, status=503,
                                     headers={"Retry-After": "1", "Kaon-Engine-Asleep": "true"})
        if "fake" in body:
            fake = body["fake"]
            return web.Response(status=fake["status"], body=fake["body"].encode(), headers=fake.get("headers"))
        if body.get("prompt") == "long":
            self.longs += 1
            return await self._stream(request, [b"data: started\n\n", b"data: [DONE]\n\n"], [self.release])
        if body.get("prompt") == "broken":  # dies mid-stream
            response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await response.prepare(request)
            await response.write(b"data: partial\n\n")
            request.transport.close()
            return response
        if body.get("prompt") == "gated":
            return await self._stream(request, self.events, self.gates, wait_first=True)
        self.quick += 1
        return web.json_response({"object": "text_completion", "model": body["model"], "backend": self.name,
                                  "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}]})

    async def _stream(self, request, events, gates, wait_first=False) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        try:
            for i, event in enumerate(events):
                if wait_first:
                    await gates[i].wait()
                await response.write(event)
                if not wait_first and i < len(gates):
                    await gates[i].wait()
            await response.write_eof()
            self.finished = True
        except asyncio.CancelledError:
            self.aborted = True
            raise
        return response


@contextlib.asynccontextmanager
async def serving(router: Router):
    """The router on a free port behind its real listening edge (connection cap, head deadline)."""
    config = router.config
    async with edge.serving(router.app(), "127.0.0.1", 0, max_connections=config.max_connections,
                            header_timeout=config.header_timeout, refused=router.metrics.overloaded.inc) as port:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as client:
            yield client


async def until(what: str, check, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        await asyncio.sleep(0.002)


def routed(*engines: FakeEngine, service: str = "svc", served_name: str = "m", **config) -> Router:
    table = EndpointTable(default_namespace=NS)  # where a bare `model` resolves (naming.py)
    table.apply_service("ADDED", isvc(service, served_name))
    for engine in engines:
        table.apply_pod("ADDED", pod(engine.name, service, port=engine.port))
    table.synced = True
    return Router(table, RouterConfig(**config), rng=random.Random(0))


def run(coro, loop: str = "asyncio"):
    """`coro` within 30 s on asyncio's loop, or on uvloop's (kaon-router's own: router/event_loop.py)."""
    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(asyncio.wait_for(coro, 30))


LOOPS = pytest.param("asyncio"), pytest.param("uvloop", marks=pytest.mark.skipif(
    importlib.util.find_spec("uvloop") is None, reason="uvloop is not installed"))
"""For @pytest.mark.parametrize("loop", LOOPS): a test of the router's own sockets on both loops it runs on."""


def metric(text: str, name: str, **labels) -> float:
    want = {k: str(v) for k, v in labels.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == want:
                return sample.value
    raise AssertionError(f"{name}{want} not in metrics:\n{text}")


closed_port = free_port  # a port bound and released again: nothing listens there


@contextlib.contextmanager
def serving_in_thread(router: Router):
    """The router behind its real listening edge on a free port, its event loop on a thread of its
    own, for clients that are not asyncio (schemathesis, httpx); yields its URL."""
    loop = asyncio.new_event_loop()
    started, stop = threading.Event(), asyncio.Event()
    ports: list[int] = []

    async def serve() -> None:
        config = router.config
        async with edge.serving(router.app(), "127.0.0.1", 0, max_connections=config.max_connections,
                                header_timeout=config.header_timeout, refused=router.metrics.overloaded.inc) as port:
            ports.append(port)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), name="router", daemon=True)
    thread.start()
    if not started.wait(30):
        pytest.fail("the router did not start listening")
    try:
        yield f"http://127.0.0.1:{ports[0]}"
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()
