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
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from e2e.control_plane import free_port
from kaon_operator.router.backoff import Backoff, candidates, ejection_seconds
from support.router import (
    NS,
    FakeEngine,
    closed_port,
    metric,
    pod,
    routed,
    run,
    serving,
    until,
)

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
    answer; `"stall"` streams one event and then nothing (a hung engine mid-stream); `"short"`
    dies part way through a JSON body.
    `calls` counts every request it got."""

    def __init__(self, name: str):
        super().__init__(name)
        self.calls = 0
        self.cancelled = 0
        self.cue: str | None = None
        """What it does whatever the prompt says (retarget())."""

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.calls += 1
        body = await request.json()
        prompt = self.cue or body.get("prompt")
        try:
            if prompt == "hang":
                await asyncio.sleep(3600)
            if prompt == "reset":
                request.transport.close()
                return web.Response()
            if prompt == "short":  # promises 100 bytes, sends 10 and dies
                response = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": "100"})
                await response.prepare(request)
                await response.write(b'{"object":')
                request.transport.close()
                return response
            if prompt == "stall":
                response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await response.prepare(request)
                await response.write(b'data: {"choices": []}\n\ndata: {"cho')  # half an event, then silence
                await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return await super()._handle(request)


def retarget(engines, prompts: dict[str, str]):
    """Each engine (pod) its own cue (`prompts[name]`), whatever prompt it gets, whichever order the router tries
    them in. Set on the engines, not by replacing a method of the router: compiled (router/compiled.py), its
    methods are read-only and call each other directly."""
    for engine in engines:
        engine.cue = prompts.get(engine.name)


async def post_many(client, n: int) -> list[tuple[int, str | None]]:
    """n completions one after another: (status, the engine that answered) of each."""
    answers = []
    for _ in range(n):
        async with client.post("/v1/completions", json={"model": "m", "prompt": "x"}) as resp:
            answers.append((resp.status, (await resp.json()).get("backend")))
    return answers


def test_no_response_headers_in_time_goes_to_another_pod_and_ejects_the_slow_one():
    async def scenario():
        hung, good = await BadEngine("hung").start(), await BadEngine("good").start()
        # 1 s: the good engine must answer within it, and a busy machine can stall this process a few tenths.
        router = routed(hung, good, first_byte_timeout=1.0)
        retarget((hung, good), {"hung": "hang"})
        async with serving(router) as client:
            answers = await post_many(client, 4)
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
        retarget((flaky, good), {"flaky": "reset"})
        async with serving(router) as client:
            answers = await post_many(client, 3)
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
        retarget((engine,), {"e0": "reset"})
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
        retarget((stalled, other), {"stalled": "stall", "other": "stall"})
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


def test_a_stream_longer_than_the_idle_timeout_but_never_silent_that_long_passes_whole():
    # The idle timer is set once per period and re-armed when it fires on a stream that sent
    # something meanwhile: here it fires twice mid-stream and must not end it.
    events = [f"data: {i}\n\n".encode() for i in range(8)] + [b"data: [DONE]\n\n"]

    async def scenario():
        engine = await FakeEngine("e0", events).start()
        # A gap a quarter of the idle timeout: a busy machine may stall this process most of a second and the
        # stream is still never silent for a whole period (0.1 s gaps under 0.3 s were not, under load).
        router = routed(engine, idle_timeout=1.0)
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "gated"}) as resp:
                for gate in engine.gates:
                    gate.set()
                    await asyncio.sleep(0.25)  # 9 events over ~2.25 s: the timer fires twice, no silence of 1 s
                body = await resp.read()
            text = await (await client.get("/metrics")).text()
        await engine.stop()
        return body, text

    body, text = run(scenario())
    assert body == b"".join(events)
    assert "kaon_router_upstream_timeouts_total{" not in text


def test_the_openai_client_raises_the_error_event_that_ends_a_stream():
    import openai  # a test dependency (pyproject's [test] extra): missing is a failure, not a skip

    async def scenario():
        engine = await BadEngine("e0").start()
        router = routed(engine, idle_timeout=0.3)
        retarget((engine,), {"e0": "stall"})
        async with serving(router) as client:
            def consume() -> Exception:
                api = openai.OpenAI(base_url=f"{str(client._base_url).rstrip('/')}/v1", api_key="none", max_retries=0)
                try:
                    for _ in api.completions.create(model="m", prompt="x", stream=True):
                        pass
                except openai.APIError as exc:
                    return exc
                raise AssertionError("the stream ended as if it were complete")

            error = await asyncio.to_thread(consume)
        await engine.stop()
        return error

    error = run(scenario())
    assert "sent no data within 0.3s" in error.message and error.body["code"] == "upstream_timeout", error.body


def test_a_json_body_cut_short_is_the_routers_own_502_not_a_truncated_200():
    # A body of known length is read whole before anything goes to the client, so a break
    # there still gets a status that says it.
    async def scenario():
        engine = await BadEngine("e0").start()
        router = routed(engine)
        async with serving(router) as client:
            async with client.post("/v1/completions", json={"model": "m", "prompt": "short"}) as resp:
                out = resp.status, await resp.json()
        await engine.stop()
        return out, router.backoff.until

    (status, body), ejected = run(scenario())
    assert status == 502 and body["error"]["code"] == "upstream_failed", body
    assert "replica e0 of InferenceService ns/svc broke off the response" in body["error"]["message"]
    assert [e.pod for e in ejected] == ["e0"]


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


# chaos against real engines -----------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]
SERVED = "smollm2"
# The router as its own process: a real Router app with a fixed table of the engines given
# (namespace "default", where a bare `model` resolves), its config from the JSON argument.
ROUTER = """
import json, sys
from aiohttp import web
from kaon_operator import api
from kaon_operator.children import resources
from kaon_operator.labels import service_labels
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.proxy import Router

port, engines, config = int(sys.argv[1]), json.loads(sys.argv[2]), json.loads(sys.argv[3])
table = EndpointTable()
table.apply_service("ADDED", {"apiVersion": api.API_VERSION, "kind": api.KIND, "spec": {"model": {
    "uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2"}}, "metadata": {
    "name": "smollm2", "namespace": "default", "creationTimestamp": "2026-01-01T00:00:00Z"}})
for name, engine_port in engines.items():
    table.apply_pod("ADDED", {"metadata": {"name": name, "namespace": "default", "labels": service_labels("smollm2")},
                              "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
                              "spec": {"containers": [{"name": "engine", "ports": [
                                  {"name": "http", "containerPort": engine_port}]}]}})
table.synced = True
web.run_app(Router(table, RouterConfig(**config)).app(), host="127.0.0.1", port=port, handler_cancellation=True,
            access_log=None, print=None)
"""
# Short limits, so that a hung engine shows within seconds (the defaults are minutes), yet
# well above a decode step of the small model on a busy 2-core machine.
LIMIT = 10
FAST = {"first_byte_timeout": LIMIT, "idle_timeout": LIMIT, "backoff": 300.0, "connect_timeout": 3.0}
# Guards against a hang: far above any limit above; a case that reaches one has failed.
HANG = 300.0


class Engines:
    """Two `kaon serve` processes on the bundled SmolLM2 (CPU), each its own process group."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.ports: dict[str, int] = {}

    def start(self, name: str) -> None:
        port = self.ports.setdefault(name, free_port())
        env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime"), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", "builtin://smollm2-135m-instruct",
               "--served-model-name", SERVED, "--port", str(port), "--device", "cpu", "--max-num-seqs", "4"]
        self.procs[name] = subprocess.Popen(cmd, stdout=(self.tmp / f"{name}.log").open("w"),
                                            stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        for name, proc in self.procs.items():
            while not _ok(f"http://127.0.0.1:{self.ports[name]}/ready"):
                if proc.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"engine {name} did not start:\n{(self.tmp / f'{name}.log').read_text()[-3000:]}")
                time.sleep(0.3)

    def ensure(self) -> None:
        """Every engine running and ready again (a case before may have killed or stopped one)."""
        for name, proc in list(self.procs.items()):
            os.kill(proc.pid, signal.SIGCONT) if proc.poll() is None else self.start(name)
        self.wait_ready()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _ok(url: str) -> bool:
    import urllib.request
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    pool = Engines(tmp_path_factory.mktemp("chaos"))
    try:
        pool.start("a")
        pool.start("b")
        pool.wait_ready()
        yield pool
    finally:
        pool.stop()


@pytest.fixture
def engine_pool(engines):
    engines.ensure()
    return engines


class RouterProcess:
    def __init__(self, engines: Engines, names=("a", "b"), port: int | None = None, **config):
        self.port = port or free_port()
        self.args = [sys.executable, "-c", ROUTER, str(self.port), json.dumps({n: engines.ports[n] for n in names}),
                     json.dumps({**FAST, **config})]
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> RouterProcess:
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**os.environ, "PYTHONPATH": f"{ROOT / 'operator'}:{ROOT}"})
        deadline = time.monotonic() + 60
        while not _ok(self.url + "/ready"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"router did not start: {self.proc.communicate()[0]}")
            time.sleep(0.1)
        return self

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.communicate(timeout=20)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def router_process(engines: Engines, **kwargs):
    router = RouterProcess(engines, **kwargs).start()
    try:
        yield router
    finally:
        router.stop()


def completion(max_tokens: int, stream: bool = True, prompt: str = "Once upon a time, in a quiet village,") -> dict:
    return {"model": SERVED, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            "ignore_eos": True}


async def events(resp: aiohttp.ClientResponse):
    """The `data:` payloads of an SSE response as they arrive."""
    async for line in resp.content:
        if line.startswith(b"data: "):
            yield line[6:].strip()


async def first_event(resp: aiohttp.ClientResponse, stream) -> bytes:
    assert resp.status == 200, await resp.text()
    return await anext(stream)


async def rest(stream) -> list[bytes]:
    return [event async for event in stream]


async def router_metrics(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url + "/metrics") as resp:
        return await resp.text()


def serving_pod(text: str) -> str:
    """The one pod with a request in flight, from the router's gauges."""
    busy = [s.labels["pod"] for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == "kaon_router_pod_inflight_requests" and s.value > 0]
    assert len(busy) == 1, busy
    return busy[0]


def test_a_stopped_engine_times_its_streams_out_cleanly_and_a_lone_one_answers_504(engine_pool):
    async def scenario(router: RouterProcess, lone: RouterProcess):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
            stuck = await session.post(router.url + "/v1/completions", json=completion(2000))
            stuck_events = events(stuck)
            await first_event(stuck, stuck_events)
            victim = serving_pod(await router_metrics(session, router.url))
            os.kill(engine_pool.procs[victim].pid, signal.SIGSTOP)  # hung: the socket stays open, nothing comes
            stuck_rest = await rest(stuck_events)
            async with session.post(router.url + "/v1/completions", json=completion(2, stream=False)) as resp:
                next_status = resp.status
            # A router whose only pod is the stopped one: no response headers in time is a 504.
            lone_url = lone.url if victim == "a" else None
            lone_answer = None
            if lone_url:
                async with session.post(lone_url + "/v1/completions", json=completion(2, stream=False)) as resp:
                    lone_answer = resp.status, await resp.json()
            return victim, stuck_rest, next_status, lone_answer, await router_metrics(session, router.url)

    with router_process(engine_pool) as router, router_process(engine_pool, names=("a",)) as lone:
        _victim, stuck_rest, next_status, lone_answer, text = run_long(scenario(router, lone))
        if lone_answer is None:  # the stream went to b: stop a on its own and ask the lone router
            os.kill(engine_pool.procs["a"].pid, signal.SIGSTOP)
            lone_answer = run_long(_ask(lone.url))
    error = json.loads(stuck_rest[-1])["error"]
    assert error["code"] == "upstream_timeout" and f"sent no data within {LIMIT}s" in error["message"], error
    assert next_status == 200  # the next request went to the running engine
    labels = {"namespace": "default", "inferenceservice": SERVED}
    assert metric(text, "kaon_router_upstream_timeouts_total", **labels, phase="idle") == 1
    status, body = lone_answer
    assert status == 504 and body["error"]["code"] == "upstream_timeout", body
    assert f"sent no response within {LIMIT}s" in body["error"]["message"]


async def _ask(url: str) -> tuple[int, dict]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
        async with session.post(url + "/v1/completions", json=completion(2, stream=False)) as resp:
            return resp.status, await resp.json()


def test_a_router_restarted_mid_load_leaves_no_client_hanging_and_serves_again(engine_pool):
    clients, outcomes = 6, []

    async def client(session: aiohttp.ClientSession, url: str, stop: asyncio.Event):
        """Streams one completion after another; a broken one is recorded and the client goes on."""
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/completions", json=completion(24)) as resp:
                    got = [e async for e in events(resp)]
                    outcomes.append("complete" if got and got[-1] == b"[DONE]" else f"cut:{got[-1:]}")
            except (aiohttp.ClientError, ConnectionError) as exc:
                outcomes.append(f"error:{type(exc).__name__}")
                await asyncio.sleep(0.2)  # reconnect

    async def scenario(router: RouterProcess):
        stop = asyncio.Event()
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
            tasks = [asyncio.create_task(client(session, router.url, stop)) for _ in range(clients)]
            await until_async(lambda: outcomes.count("complete") >= 3)
            router.kill()  # mid-load: streams in flight
            before = len(outcomes)
            await until_async(lambda: len(outcomes) >= before + clients)  # every client saw the break
            await asyncio.to_thread(router.start)
            await until_async(lambda: outcomes[before:].count("complete") >= 2 * clients)
            stop.set()
            await asyncio.wait_for(asyncio.gather(*tasks), HANG)  # nothing hangs
            engines_busy = [await _running(session, port) for port in engine_pool.ports.values()]
            return before, engines_busy

    router = RouterProcess(engine_pool).start()
    try:
        before, engines_busy = run_long(scenario(router))
    finally:
        router.stop()
    assert outcomes[:before].count("complete") >= 3
    broken = [o for o in outcomes if o != "complete"]
    # A broken stream is an error to its client, never a short success.
    assert broken and all(o.startswith("error:") for o in broken), broken
    assert engines_busy == [0, 0]  # the requests the dead router left were aborted by the engines


async def _running(session: aiohttp.ClientSession, port: int) -> float:
    async def running() -> float:
        async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
            return metric(await resp.text(), "kaon_num_requests_running")
    deadline = time.monotonic() + 30
    while True:  # polls another process's /metrics: nothing in this loop to await instead
        value = await running()
        if not value or time.monotonic() >= deadline:
            return value
        await asyncio.sleep(0.2)


async def until_async(check, timeout: float = HANG):
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail("timed out waiting for the chaos case to progress")
        await asyncio.sleep(0.05)


def run_long(coro):
    return asyncio.run(asyncio.wait_for(coro, 3 * HANG))


# Last: the engine it kills is not started again for a case after it.
def test_an_engine_killed_mid_stream_ends_its_stream_cleanly_and_gets_no_more_requests(engine_pool):
    async def scenario(router: RouterProcess):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=HANG)) as session:
            doomed = await session.post(router.url + "/v1/completions", json=completion(2000))
            doomed_events = events(doomed)
            await first_event(doomed, doomed_events)
            victim = serving_pod(await router_metrics(session, router.url))
            # Least connections: the second stream goes to the other engine.
            survivor = await session.post(router.url + "/v1/completions", json=completion(30))
            survivor_events = events(survivor)
            await first_event(survivor, survivor_events)
            engine_pool.procs[victim].kill()  # SIGKILL, mid-stream
            engine_pool.procs[victim].wait()
            doomed_rest, survivor_rest = await asyncio.gather(rest(doomed_events), rest(survivor_events))
            after = []
            for _ in range(4):
                async with session.post(router.url + "/v1/completions", json=completion(2, stream=False)) as resp:
                    after.append(resp.status)
            return victim, doomed_rest, survivor_rest, after, await router_metrics(session, router.url)

    with router_process(engine_pool) as router:
        victim, doomed_rest, survivor_rest, after, text = run_long(scenario(router))
    # The killed engine's client: a clean end with an OpenAI error event (no hang, no broken body).
    error = json.loads(doomed_rest[-1])["error"]
    assert error["code"] == "upstream_failed" and f"replica {victim} of" in error["message"], error
    assert set(error) == {"message", "type", "param", "code"}
    # The other engine's stream: untouched, to its last token and [DONE].
    assert survivor_rest[-1] == b"[DONE]" and json.loads(survivor_rest[-2])["choices"][0]["finish_reason"] == "length"
    # The next requests went straight to the other engine: none was even tried on the dead one.
    assert after == [200] * 4
    labels = {"namespace": "default", "inferenceservice": SERVED}
    assert "kaon_router_retries_total{" not in text  # no attempt failed: a counter with no sample yet
    assert metric(text, "kaon_router_ejected_endpoints", **labels) == 1
    assert metric(text, "kaon_router_broken_streams_total", **labels) == 1
