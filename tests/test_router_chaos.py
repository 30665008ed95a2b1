"""The router when engines fail: timeouts, retries before the first byte, outlier ejection.

First the pure decisions, then the HTTP path against fake engines that hang, reset or stall on
cue (deterministic), then chaos against real `kaon serve` engines (the bundled SmolLM2) run as
processes: one killed with SIGKILL mid-stream, one stopped with SIGSTOP, and the router itself
killed and started again mid-load. The router there is a real `Router` app in its own process
with a fixed endpoint table (the watch is tested against a real apiserver in
test_router_k8s.py); the timeouts are set short by its flags so that the cases run fast.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kaon_operator.router.balance import Backoff, candidates, ejection_seconds
from test_router import NS, FakeEngine, closed_port, metric, pod, routed, run, serving, until


# pure decisions ---------------------------------------------------------------------


def test_ejection_doubles_while_a_pod_keeps_failing_and_an_answer_or_the_watch_clears_it():
    assert [ejection_seconds(5.0, n) for n in (1, 2, 3, 4, 5)] == [5.0, 10.0, 20.0, 40.0, 40.0]
    backoff = Backoff(1.0)
    assert backoff.fail("a", now=0.0) == 1.0
    assert candidates(["a", "b"], set(), backoff.until, now=0.5) == ["b"]
    assert backoff.fail("a", now=2.0) == 2.0  # let back in after 1 s, failed again: out for longer
    assert backoff.ejected(now=3.0) == ["a"] and backoff.ejected(now=4.0) == []
    backoff.succeed("a")  # the trial request after the ejection got an answer
    assert backoff.fail("a", now=10.0) == 1.0
    backoff.fail("b", now=10.0)
    backoff.keep_only(lambda e: e == "b")  # the watch saw "a" leave the ready set
    assert set(backoff.until) == set(backoff.failures) == {"b"}
    assert backoff.fail("a", now=10.0) == 1.0  # back and ready anew: a first failure again


# the HTTP path against fake engines that misbehave ----------------------------------


class BadEngine(FakeEngine):
    """Also: `prompt: "hang"` never answers; `"reset"` closes the connection without an
    answer; `"stall"` streams one event and then nothing (a hung engine mid-stream).
    `calls` counts every request it got."""

    def __init__(self, name: str):
        super().__init__(name)
        self.calls = 0
        self.cancelled = 0

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        try:
            if body.get("prompt") == "hang":
                await asyncio.sleep(3600)
            if body.get("prompt") == "reset":
                request.transport.close()
                return web.Response()
            if body.get("prompt") == "stall":
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b'data: {"choices": []}\n\ndata: {"cho')  # half an event, then silence
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super()._handle(request)


def retarget(router, prompts: dict[str, str]):
    """Rewrite the prompt per engine: the fake engines misbehave as the prompt says, so each
    pod gets its own cue (`prompts[pod]`) whichever order the router tries them in."""
    original = router._send

    async def send(request, body, key, target, tried):
        payload = json.loads(body)
        payload["prompt"] = prompts.get(target.pod, payload["prompt"])
        return await original(request, json.dumps(payload).encode(), key, target, tried)

    router._send = send


def test_no_response_headers_in_time_goes_to_another_pod_and_ejects_the_slow_one():
    async def scenario():
        hung, good = await BadEngine("hung").start(), await BadEngine("good").start()
        router = routed(hung, good, first_byte_timeout=0.3)
        retarget(router, {"hung": "hang"})
        async with serving(router) as client:
            answers = []
            for _ in range(4):
                async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    answers.append((resp.status, (await resp.json()).get("backend")))
            await until("the hung engine to see its request cancelled", lambda: hung.cancelled == hung.calls)
            text = await (await client.get("/metrics")).text()
        await hung.stop(), await good.stop()
        return answers, hung.calls, text

    answers, hung_calls, text = run(scenario())
    assert answers == [(200, "good")] * 4
    assert hung_calls <= 1  # tried at most once: then ejected
    labels = {"namespace": NS, "inferenceservice": "svc"}
    assert metric(text, "kaon_router_upstream_timeouts_total", **labels, phase="first_byte") == hung_calls
    assert metric(text, "kaon_router_ejected_endpoints", **labels) == hung_calls


def test_every_pod_timing_out_is_a_504_in_openai_shape_after_max_attempts():
    async def scenario():
        engines = [await BadEngine(f"e{i}").start() for i in range(3)]
        router = routed(*engines, first_byte_timeout=0.2, max_attempts=2)
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "hang"}) as resp:
                out = resp.status, await resp.json(), resp.headers.get("Retry-After")
        for engine in engines:
            await engine.stop()
        return out, sum(e.calls for e in engines)

    (status, body, retry_after), calls = run(scenario())
    assert status == 504 and retry_after == "1" and calls == 2
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == "upstream_timeout" and body["error"]["type"] == "server_error"
    assert "sent no response within 0.2s (2 replicas tried)" in body["error"]["message"]


def test_a_connection_reset_before_any_answer_is_retried_elsewhere():
    async def scenario():
        flaky, good = await BadEngine("flaky").start(), await BadEngine("good").start()
        router = routed(flaky, good)
        retarget(router, {"flaky": "reset"})
        async with serving(router) as client:
            answers = []
            for _ in range(3):
                async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                    answers.append((resp.status, (await resp.json()).get("backend")))
            text = await (await client.get("/metrics")).text()
        await flaky.stop(), await good.stop()
        return answers, flaky.calls, text

    answers, flaky_calls, text = run(scenario())
    assert answers == [(200, "good")] * 3 and flaky_calls <= 1
    assert metric(text, "kaon_router_retries_total", namespace=NS, inferenceservice="svc") == flaky_calls


def test_only_resetting_pods_is_a_502_with_the_reason():
    async def scenario():
        engine = await BadEngine("e0").start()
        router = routed(engine)
        router.table.apply_pod("ADDED", pod("dead", port=closed_port()))
        retarget(router, {"e0": "reset"})
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
                out = resp.status, await resp.json()
        await engine.stop()
        return out

    status, body = run(scenario())
    assert status == 502 and body["error"]["code"] in ("upstream_failed", "upstream_unreachable"), body


def test_a_stream_that_goes_silent_ends_with_a_timeout_event_and_is_not_retried():
    async def scenario():
        stalled, other = await BadEngine("stalled").start(), await BadEngine("other").start()
        router = routed(stalled, other, idle_timeout=0.3)
        retarget(router, {"stalled": "stall", "other": "stall"})
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "x", "stream": True}) as resp:
                status, body = resp.status, await resp.read()  # ends: no hang, no ClientPayloadError
            await until("the engine to see the request cancelled",
                        lambda: stalled.cancelled + other.cancelled == 1)
            text = await (await client.get("/metrics")).text()
        await stalled.stop(), await other.stop()
        return status, body, stalled.calls + other.calls, text

    status, body, calls, text = run(scenario())
    assert status == 200 and calls == 1  # a response had begun: never repeated
    events = body.split(b"\n\n")
    assert events[0] == b'data: {"choices": []}' and events[2:] == [b""], body  # the half event is dropped
    error = json.loads(events[1].removeprefix(b"data: "))["error"]
    assert error["code"] == "upstream_timeout" and "sent no data within 0.3s" in error["message"], error
    labels = {"namespace": NS, "inferenceservice": "svc"}
    assert metric(text, "kaon_router_upstream_timeouts_total", **labels, phase="idle") == 1
    assert metric(text, "kaon_router_broken_streams_total", **labels) == 1
    assert metric(text, "kaon_router_ejected_endpoints", **labels) == 1


def test_the_watch_seeing_a_pod_ready_anew_lets_it_back_at_once():
    async def scenario():
        engine = await BadEngine("e0").start()
        router = routed(engine, backoff=3600)
        router.table.apply_pod("ADDED", pod("other", port=engine.port))
        router.backoff.fail(router.table.endpoints(router.table.resolve("m"))[0], 0.0)
        assert len(router.backoff.failures) == 1
        first = router.table.endpoints(router.table.resolve("m"))[0]
        router.table.apply_pod("MODIFIED", pod(first.pod, port=engine.port, ready=False))
        router.table.apply_pod("MODIFIED", pod(first.pod, port=engine.port))
        await engine.stop()
        return router.backoff.failures, router.backoff.until

    failures, until_ = run(scenario())
    assert failures == {} and until_ == {}
