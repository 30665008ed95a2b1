"""The operator's limits without a cluster: which objects it may apply over (ownership.py), a
hung apiserver (a timeout and an error, not a hang), an engine's /metrics too large to read."""
from __future__ import annotations

import asyncio
import socket
import time

import aiohttp
import kubernetes
import pytest
from aiohttp import web

from kaon_operator.autoscaling import scraper
from kaon_operator.children import ownership
from kaon_operator.kube import Kube, TimedApiClient


def service(uid: str | None, kind: str = "InferenceService") -> dict:
    refs = [{"apiVersion": "kaon.dev/v1alpha1", "kind": kind, "name": "chat", "uid": uid, "controller": True}]
    return {"kind": "Service", "metadata": {"name": "chat", "ownerReferences": refs if uid else []}}


def test_only_what_stands_absent_or_is_controlled_by_the_same_owner_is_applied_over():
    manifest = service("uid-1")
    assert ownership.foreign_holder(None, manifest) is None
    assert ownership.foreign_holder(service("uid-1"), manifest) is None
    assert "made by someone else" in ownership.foreign_holder(service(None), manifest)
    assert "uid-0" in ownership.foreign_holder(service("uid-0"), manifest)  # an InferenceService of the same name, gone
    assert "Deployment chat" in ownership.foreign_holder(service("uid-2", kind="Deployment"), manifest)
    not_controller = service("uid-1")
    not_controller["metadata"]["ownerReferences"][0]["controller"] = False
    assert ownership.foreign_holder(not_controller, manifest) is not None


def test_a_hung_apiserver_is_a_timeout_and_an_error_not_a_hang():
    with socket.socket() as listener:  # accepts connections, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        config = kubernetes.client.Configuration()
        config.host = f"http://127.0.0.1:{listener.getsockname()[1]}"
        config.retries = 0
        start = time.monotonic()
        with pytest.raises(Exception) as failed:  # the dynamic client's discovery is the first request
            Kube(TimedApiClient(config, timeout=(1.0, 0.5))).list_pods("ns", "a=b")
        assert time.monotonic() - start < 15  # a few 0.5 s reads, with room for a busy machine; no timeout hangs
        assert "timed out" in repr(failed.value).lower() or "timeout" in repr(failed.value).lower()


def test_an_engine_metrics_page_over_the_cap_is_left_out():
    async def scenario():
        async def huge(request):
            response = web.StreamResponse()
            await response.prepare(request)
            for _ in range(100):
                await response.write(b"# " + b"x" * 65534 + b"\n")
            return response

        async def small(request):
            return web.Response(text="kaon_num_requests_running 1\n")
        app = web.Application()
        app.router.add_get("/huge", huge)
        app.router.add_get("/small", small)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        try:
            async with aiohttp.ClientSession() as session:
                assert await scraper.fetch(session, f"{url}/huge", 5, limit=1 << 20) is None
                assert await scraper.fetch(session, f"{url}/small", 5, limit=1 << 20) == "kaon_num_requests_running 1\n"
        finally:
            await runner.cleanup()

    asyncio.run(scenario())
