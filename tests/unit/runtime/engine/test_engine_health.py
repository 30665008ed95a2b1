"""Liveness that means it: /health is 503 when requests are pending and no engine step completes.

A stand-in LLMEngine whose step() blocks until the test lets it go plays a wedged step (a stuck
collective, a GPU fault); time is passed to AsyncEngine.health() explicitly, so nothing here waits
for a timeout to elapse.
"""
from __future__ import annotations

import contextlib
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kaon_runtime.engine.async_engine import FIRST_STEP_ALLOWANCE, AsyncEngine
from kaon_runtime.engine.llm_engine import EngineStats
from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.server.app import ServerSettings, create_app

STALL_S = 30.0


class WedgeableEngine:
    """The LLMEngine surface AsyncEngine uses; each step waits for `release` (set: steps run freely)."""

    max_model_len = 64
    model_config = SimpleNamespace(vocab_size=100)

    def __init__(self):
        self.requests: dict[str, int] = {}
        self.release = threading.Event()
        self.started = 0  # steps begun (each may then wait for `release`)

    def validate(self, prompt, params):
        return [1, 2, 3]

    def lora_id(self, adapter):
        return 0  # the base model: no adapters here

    def add_validated(self, request_id, prompt_token_ids, params, lora_id=0, kv=None):
        self.requests[request_id] = params.max_tokens

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        self.started += 1
        self.release.wait()
        outputs = []
        for request_id in list(self.requests):
            self.requests[request_id] -= 1
            finished = self.requests[request_id] <= 0
            if finished:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id=request_id, prompt="", prompt_token_ids=[1, 2, 3], outputs=[
                CompletionOutput(index=0, text="x", token_ids=[7], finish_reason="length" if finished else None)],
                ))
        return outputs

    def stats(self):
        return EngineStats(num_running=len(self.requests), num_waiting=0, kv_cache_usage=0.0, prefix_cache_queries=0,
                           prefix_cache_hits=0, num_preemptions=0, prompt_tokens=0, generation_tokens=0)


@pytest.fixture
def wedge():
    return WedgeableEngine()


@contextlib.contextmanager
def serving(engine: AsyncEngine, wedge: WedgeableEngine):
    """The app on a TestClient; whatever happens in the test, the wedged step is let go first, so a
    failed assertion fails the test instead of hanging it in the engine thread's join."""
    with TestClient(create_app(engine, ServerSettings(model_name="m"))) as http:
        try:
            yield http
        finally:
            wedge.release.set()


def _wait_for(predicate, what: str):
    deadline = time.monotonic() + 30  # a liveness bound on the test itself, not an assertion on speed
    while not predicate():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def test_stalled_step_with_pending_request_is_unhealthy_and_recovers(wedge):
    engine = AsyncEngine(wedge, stall_timeout_s=STALL_S)
    with serving(engine, wedge) as http:
        assert http.get("/health").status_code == 200
        assert engine.health(now=time.monotonic() + 10 * STALL_S) is None  # idle for ages: nothing pending, healthy

        # The first step hangs: it has FIRST_STEP_ALLOWANCE stall timeouts (kernel compilation, graph capture).
        wedge.release.clear()
        http.portal.call(engine.add_request, "r1", "hi", SamplingParams(max_tokens=2))
        _wait_for(lambda: wedge.started == 1, "the first step to begin (and hang)")
        start = engine._progress_at
        assert engine.health(now=start + STALL_S * FIRST_STEP_ALLOWANCE - 1) is None
        problem = engine.health(now=start + STALL_S * FIRST_STEP_ALLOWANCE + 1)
        assert problem is not None and "stalled" in problem and "1 request(s) pending" in problem

        # Steps complete again: healthy; a later hang gets one stall timeout only.
        wedge.release.set()
        _wait_for(lambda: not engine.engine.requests, "the first request to finish")
        wedge.release.clear()
        begun = wedge.started
        http.portal.call(engine.add_request, "r2", "hi", SamplingParams(max_tokens=3))
        _wait_for(lambda: wedge.started > begun, "the second request's first step to begin (and hang)")
        assert engine._steps >= 1
        assert engine.health(now=engine._progress_at + STALL_S - 1) is None
        assert engine.health(now=engine._progress_at + STALL_S + 1) is not None

        # /health says so, in OpenAI's error shape; /ready too (a stalled engine takes no traffic).
        engine.stall_timeout_s = 1e-9
        resp = http.get("/health")
        assert resp.status_code == 503
        error = resp.json()["error"]
        assert error["code"] == "engine_stalled" and error["type"] == "server_error" and "stalled" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        assert http.get("/ready").status_code == 503

        engine.stall_timeout_s = STALL_S
        wedge.release.set()
        _wait_for(lambda: not engine.engine.requests, "the second request to finish")
        assert http.get("/health").status_code == 200


def test_stall_check_off_with_zero(wedge):
    engine = AsyncEngine(wedge, stall_timeout_s=0)
    engine._idle, engine._num_queued = False, 3
    engine._thread = SimpleNamespace(is_alive=lambda: True)
    assert engine.health(now=time.monotonic() + 1e6) is None


def test_dead_engine_is_unhealthy(wedge):
    engine = AsyncEngine(wedge)
    with serving(engine, wedge) as http:
        engine._error = RuntimeError("boom")
        body = http.get("/health").json()
        assert body["error"]["code"] == "engine_dead"
