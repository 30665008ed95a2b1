"""Namespaced services for the router's tenancy tests: an event recorder, InferenceService and
pod objects, a router on a port."""
from __future__ import annotations

import hashlib

from aiohttp import web

from kaon_operator.labels import service_labels
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.proxy import Router


class Recorder:
    """An engine stand-in that answers 200 and keeps the body and Authorization it received."""

    def __init__(self):
        self.seen: list[tuple[bytes, str | None]] = []
        self.port = 0

    async def start(self) -> Recorder:
        async def handle(request: web.Request) -> web.Response:
            self.seen.append((await request.read(), request.headers.get("Authorization")))
            return web.json_response({"ok": True})
        app = web.Application()
        app.router.add_post("/v1/{tail:.+}", handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.port = self._runner.addresses[0][1]
        return self

    async def stop(self) -> None:
        await self._runner.cleanup()


def isvc(namespace: str, name: str, served: str | None = None, created: str = "2026-01-01T00:00:00Z",
         secret: str | None = None, keys: tuple[str, ...] | None = None, published_for: str | None = None) -> dict:
    """With `keys`: the digests the operator publishes in status.auth for `published_for`
    (default: `secret`), as key_digests.py writes them."""
    spec = {"model": {"uri": "builtin://x", **({"servedName": served} if served else {})}}
    if secret:
        spec["auth"] = {"apiKeySecret": secret}
    status = {} if keys is None else {"auth": {"apiKeySecret": published_for or secret, "keyDigests": sorted(
        hashlib.sha256(k.encode()).hexdigest() for k in keys)}}
    return {"metadata": {"namespace": namespace, "name": name, "creationTimestamp": created}, "spec": spec,
            "status": status}


def engine_pod(namespace: str, service: str, port: int) -> dict:
    return {"metadata": {"name": f"{service}-0", "namespace": namespace, "labels": service_labels(service)},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]}}


async def serve(table: EndpointTable):
    runner = web.AppRunner(Router(table, RouterConfig(queue_timeout=0.2)).app(), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"
