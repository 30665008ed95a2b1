"""The adapter loop against hostile engine pods (issue 48, item 6), as a tenant would act: its pod
answers /v1/models with an endless body, or takes a load and never answers. The loop reads a
bounded number of bytes, and another tenant's adapter is still loaded within a round; a spec the
admin's policy refuses gets no API key sent to its pods."""
from __future__ import annotations

import asyncio
import base64
import time

import aiohttp
from aiohttp import web

from kaon_operator.api import Key
from kaon_operator.config import OperatorConfig, SpecPolicy
from kaon_operator.lora import adapter_sync
from kaon_operator.records import Records
from kaon_operator.status.summaries import PodSummary

ADAPTER = {"name": "sql", "uri": "s3://bucket/adapters/sql"}
HUGE_BYTES = 64 << 20  # the attacker's /v1/models: 64 MiB (a real one is a few KiB)


class Tenant:
    """One engine pod: `mode` "honest", "huge" (/v1/models streams HUGE_BYTES) or "stall" (a load never answers)."""

    def __init__(self, mode: str):
        self.mode, self.loaded, self.sent, self.calls, self.headers = mode, {}, 0, [], []
        self.release = asyncio.Event()  # set at the test's end: a stalled load answers, the server stops
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/load_lora_adapter", self.load)

    async def models(self, request):
        self.headers.append(request.headers.get("Authorization"))
        if self.mode != "huge":
            return web.json_response({"data": [{"id": "base"}] + [
                {"id": n, "parent": "base", "root": p} for n, p in self.loaded.items()]})
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        await response.write(b'{"data": [')
        chunk = b"{}," * ((1 << 16) // 3)
        try:
            while self.sent < HUGE_BYTES:
                await response.write(chunk)
                self.sent += len(chunk)
        except (ConnectionError, RuntimeError):  # the reader hung up: what it cost is self.sent
            pass
        return response

    async def load(self, request):
        body = await request.json()
        self.calls.append(body["lora_name"])
        if self.mode == "stall":
            await self.release.wait()
        self.loaded[body["lora_name"]] = body["lora_path"]
        return web.Response(text="Success")


class Caches:
    def __init__(self, services):
        self.services = services  # key -> (body, pods)

    def all_inference_services(self):
        return [(key, body) for key, (body, _) in self.services.items()]

    def pods(self, key):
        return self.services[key][1]

    def adapter_pods(self, key):
        return self.services[key][1]


class Kube:
    def patch_status(self, namespace, name, patch):
        pass

    def secret_data(self, namespace, name, owner_uid=None):
        return {"k": base64.b64encode(f"key-of-{namespace}".encode()).decode()}


class Ctx:
    def __init__(self, services, policy: SpecPolicy | None = None):
        self.caches, self.kube, self.records = Caches(services), Kube(), Records()
        self.config, self.events = OperatorConfig(spec_policy=policy or SpecPolicy()), []

    def post(self, body, events):
        self.events += events


async def _serve(tenants):
    runners, pods = [], []
    for i, tenant in enumerate(tenants):
        runner = web.AppRunner(tenant.app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        pods.append([PodSummary(f"p{i}", ip=f"127.0.0.1:{runner.addresses[0][1]}", ready=True)])
    return runners, pods


def _body(namespace, **spec):
    return {"metadata": {"namespace": namespace, "name": "svc"},
            "spec": {"model": {"uri": "hf://org/base"}, "adapters": [ADAPTER], **spec}}


def _loop(ctx):
    return adapter_sync.AdapterLoop(ctx, interval=2.0, url_of=lambda pod: f"http://{pod.ip}")  # type: ignore[arg-type]


def _run(tenants, check):
    """`check(loop, session, tenants)` with one service per tenant (namespaces t0, t1, ...: the caches'
    order, so a loop that serves tenants one by one meets the first ones first)."""
    async def scenario():
        runners, pods = await _serve(tenants)
        services = {Key(f"t{i}", "svc"): (_body(f"t{i}"), pods[i]) for i in range(len(tenants))}
        loop = _loop(Ctx(services))
        try:
            async with aiohttp.ClientSession() as session:
                await check(loop, session)
        finally:
            for tenant in tenants:
                tenant.release.set()
            for task in getattr(loop, "tasks", {}).values():
                task.cancel()
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())


def test_an_endless_models_body_is_read_only_up_to_the_cap(monkeypatch):
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)
    huge, honest = Tenant("huge"), Tenant("honest")

    async def check(loop, session):
        await asyncio.wait_for(loop.tick_all(session), 30)
        assert huge.loaded == {} and huge.sent < 8 << 20, f"read {huge.sent} bytes of a hostile /v1/models"
        assert honest.loaded == {"sql": ADAPTER["uri"]}

    _run([huge, honest], check)


def test_a_pod_that_never_answers_a_load_delays_no_other_tenant(monkeypatch):
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)
    stall, honest = Tenant("stall"), Tenant("honest")

    async def check(loop, session):
        start = time.monotonic()
        await asyncio.wait_for(loop.tick_all(session), 30)
        assert honest.loaded == {"sql": ADAPTER["uri"]}, "the victim's adapter waited on another tenant"
        assert time.monotonic() - start < 25  # far under the stalled load's own 600 s timeout
        assert stall.calls == ["sql"]  # its load is still held by its pod, in its own task
        await asyncio.wait_for(loop.tick_all(session), 30)
        assert stall.calls == ["sql"], "a service whose round still runs got a second one"

    _run([stall, honest], check)


def test_a_refused_spec_gets_no_key_sent_to_its_pods(monkeypatch):
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)

    async def scenario():
        pod = Tenant("honest")
        runners, pods = await _serve([pod])
        body = _body("ns", auth={"apiKeySecret": "someone-elses"}, engine={"image": "attacker.example/exfil"})
        loop = _loop(Ctx({Key("ns", "svc"): (body, pods[0])}, SpecPolicy(allowed_images=("ghcr.io/kaon-dev/kaon",))))
        try:
            async with aiohttp.ClientSession() as session:
                await asyncio.wait_for(loop.tick_all(session), 30)
                assert pod.headers == [] and pod.loaded == {}
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())
