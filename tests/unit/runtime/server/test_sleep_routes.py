"""Issue 53: the sleep routes on the app (server/sleep.py), on test_pipeline.py's stand-in engine with
the engine's own sleep replaced by a recorder: who may call them, what answers while asleep."""
from __future__ import annotations

import asyncio

import pytest
from fastapi.testclient import TestClient

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.sleep import EngineAsleepError, Sleep
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.server import sleep as sleep_routes
from kaon_runtime.server.app import ServerSettings, create_app
from tests.unit.runtime.server.test_pipeline import MODEL, StubEngine

ADMIN = {"Authorization": "Bearer admin"}
SERVING = {"Authorization": "Bearer serving"}
COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture
def calls(monkeypatch):
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(sleep_routes, "unsupported", lambda engine, level: None if level in (1, 2) else "bad level")
    monkeypatch.setattr(sleep_routes, "put_to_sleep", lambda engine, level: seen.append(("sleep", level)) or
                        Sleep(level, 8))
    monkeypatch.setattr(sleep_routes, "wake_up", lambda engine, slept: seen.append(("wake", slept.level)))
    return seen


def _client(**settings) -> TestClient:
    app = create_app(AsyncEngine(StubEngine()), ServerSettings(model_name=MODEL, api_key="serving", **settings))
    return TestClient(app)


def test_the_routes_are_off_unless_enabled_and_need_the_admin_key(calls):
    with _client(admin_key="admin") as http:  # sleep mode off: no such routes, even for the admin
        for method, path in (("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping")):
            assert getattr(http, method)(path, headers=ADMIN).status_code == 404
    with _client(admin_key="admin", sleep_mode=True) as http:
        for headers in ({}, SERVING, {"Authorization": "Bearer nope"}):
            refused = http.post("/sleep", headers=headers)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
        assert http.get("/is_sleeping", headers=SERVING).status_code == 401
    assert calls == []


def test_asleep_the_server_is_alive_not_ready_and_refuses_generation(calls):
    with _client(admin_key="admin", sleep_mode=True) as http:
        assert http.post("/v1/completions", json=COMPLETION, headers=SERVING).status_code == 200
        assert http.post("/sleep", params={"level": 2}, headers=ADMIN).status_code == 200
        assert http.get("/is_sleeping", headers=ADMIN).json() == {"is_sleeping": True}
        assert http.get("/health").status_code == 200
        ready = http.get("/ready")
        assert ready.status_code == 503 and ready.json()["error"]["code"] == "engine_asleep"
        for path, body in (("/v1/completions", COMPLETION),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}),
                           ("/v1/responses", {"model": MODEL, "input": "x"})):
            refused = http.post(path, json=body, headers=SERVING)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_asleep", path
            assert refused.headers["Kaon-Engine-Asleep"] == "true"  # the router tries another replica on it
            assert refused.headers["retry-after"]
        assert http.get("/v1/models", headers=SERVING).status_code == 200
        assert http.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=SERVING).status_code == 200
        assert http.post("/sleep", params={"level": 2}, headers=ADMIN).status_code == 200  # again: no change
        assert http.post("/sleep", params={"level": 1}, headers=ADMIN).status_code == 400  # another level: wake first
        tags = http.post("/wake_up", params={"tags": "weights"}, headers=ADMIN)
        assert tags.status_code == 400 and tags.json()["error"]["param"] == "tags"
        assert http.post("/wake_up", headers=ADMIN).status_code == 200
        assert http.post("/wake_up", headers=ADMIN).status_code == 200  # awake already: nothing to do
        assert http.get("/ready").status_code == 200
        assert http.post("/v1/completions", json=COMPLETION, headers=SERVING).status_code == 200
    assert calls == [("sleep", 2), ("wake", 2)]


def test_a_level_the_engine_cannot_sleep_at_is_a_400_and_leaves_it_awake(calls):
    with _client(admin_key="admin", sleep_mode=True) as http:
        bad = http.post("/sleep", params={"level": 3}, headers=ADMIN)
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "bad level"
        assert http.get("/ready").status_code == 200
    assert calls == []


def test_a_request_that_reaches_a_sleeping_engine_fails_clearly():
    """The race the routes' check cannot close: a request validated while the sleep began."""
    async def scenario() -> None:
        engine = AsyncEngine(StubEngine())
        engine.start()
        asleep = False
        engine.refuse_new = lambda: EngineAsleepError("asleep") if asleep else None
        try:
            running = await engine.add_request("long", "hi", SamplingParams(max_tokens=10_000))
            await running.__anext__()
            asleep = True
            await engine.call(lambda e: e.abort_request("long"))  # what put_to_sleep does to what is left
            with pytest.raises(EngineAsleepError):
                async for _ in running:
                    pass
            late = await engine.add_request("late", "hi", SamplingParams(max_tokens=1))
            with pytest.raises(EngineAsleepError):
                await late.__anext__()
        finally:
            await engine.stop()

    asyncio.run(scenario())


class _HeldStub(StubEngine):
    """One token per request, then no more until the request is aborted: a stream still running when a sleep
    comes, on any machine's timing."""

    def __init__(self):
        super().__init__()
        self.started: set[str] = set()

    def step(self):
        held = {r: v for r, v in self.requests.items() if r in self.started}
        self.requests = {r: v for r, v in self.requests.items() if r not in held}  # the new ones: one token
        self.started |= set(self.requests)
        try:
            return super().step()
        finally:
            self.requests.update(held)


@pytest.mark.parametrize("path, body, error_of", [
    ("/v1/completions", {**COMPLETION, "max_tokens": 8}, lambda event: event["error"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 8},
     lambda event: event["error"]),
    ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 8}, lambda event: event),
])
def test_a_stream_a_sleep_aborts_ends_with_an_error_that_says_asleep(monkeypatch, path, body, error_of):
    """A stream in flight when the sleep's grace runs out is cut by the sleep (put_to_sleep aborts what is left):
    its last event is the error, with the code a request refused while asleep gets (`engine_asleep`), not a
    bare server error, so a client tells a sleeping engine (retry elsewhere) from a dead one."""
    import json
    import threading
    import time

    monkeypatch.setattr(sleep_routes, "unsupported", lambda engine, level: None)
    monkeypatch.setattr(sleep_routes, "put_to_sleep", lambda engine, level: [
        engine.abort_request(r) for r in list(engine.requests)] and Sleep(level, 8))
    stub = _HeldStub()
    app = create_app(AsyncEngine(stub), ServerSettings(model_name=MODEL, api_key="serving", admin_key="admin",
                                                       sleep_mode=True, sleep_grace_s=0))
    with TestClient(app) as http:
        lines: list[str] = []
        body = {**body, "stream": True}
        streaming = threading.Thread(target=lambda: lines.extend(
            http.post(path, json=body, headers=SERVING).text.splitlines()))
        streaming.start()
        deadline = time.monotonic() + 60
        while not stub.started:  # its first token computed: the stream runs
            assert time.monotonic() < deadline and streaming.is_alive()
            time.sleep(0.01)
        assert http.post("/sleep", params={"level": 1}, headers=ADMIN).status_code == 200
        streaming.join(60)
        assert not streaming.is_alive()
    events = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data: {")]
    error = error_of(events[-1])
    assert error["code"] == "engine_asleep" and "asleep" in error["message"], events[-1]
