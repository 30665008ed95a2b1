"""Issue 48, the router's items, tried as an attacker would: real sockets against the router's app
behind its real listening edge, engine stand-ins on real ports that record what reaches them.

1. A namespace named like a model's organisation (`meta-llama`) cannot take the default
   namespace's `meta-llama/Llama-3.1-8B-Instruct`, nor the key sent for it; no pod gets a
   client's credentials, cookies or X-Forwarded-* (a keyed one gets its own key back).
2. Only the engine's OpenAI routes are forwarded: not its adapter admin routes, however spelled.
3. One client's idle uploads cannot fill the byte budget for everyone; a body whose JSON costs
   far more than its bytes is refused before it is parsed (test_router_memory.py: the router
   process's memory under the twelve-body attack).
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
from aiohttp import web

from kaon_operator import naming
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable, ServiceKey
from kaon_operator.router.proxy import Router
from kaon_operator.router.request import upstream_headers
from support.router import run, serving, until
from support.tenancy import engine_pod, isvc

VICTIM_KEY = "victim-key"
CLIENT_HEADERS = {"Cookie": "session=victim", "X-Forwarded-For": "10.0.0.7", "X-Forwarded-Host": "victim.example",
                  "Forwarded": "for=10.0.0.7", "X-Real-IP": "10.0.0.7", "X-Api-Key": "other", "X-Kept": "1",
                  "X-Auth-Token": "victim-token", "X-Amz-Security-Token": "victim-session", "X-Goog-Api-Key": "victim",
                  "X-Original-Forwarded-For": "10.0.0.7", "X-Client-IP": "10.0.0.7", "True-Client-IP": "10.0.0.7",
                  "CF-Connecting-IP": "10.0.0.7", "X-Cluster-Client-IP": "10.0.0.7"}


class Recorder:
    """An engine stand-in that answers every method and path with 200, keeping each request's
    method, path and headers."""

    async def start(self) -> Recorder:
        self.seen: list[tuple[str, str, dict]] = []

        async def handle(request: web.Request) -> web.Response:
            await request.read()
            self.seen.append((request.method, request.raw_path, dict(request.headers)))
            return web.json_response({"ok": True})
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", handle)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self


def router_of(services: list[tuple[dict, int]], **config) -> Router:
    table = EndpointTable(default_namespace="default")
    for service, port in services:
        table.apply_service("ADDED", service)
        meta = service["metadata"]
        table.apply_pod("ADDED", engine_pod(meta["namespace"], meta["name"], port))
    table.synced = True
    return Router(table, RouterConfig(queue_timeout=0.2, **config))


# 1. names and credentials ------------------------------------------------------------------------


def test_a_namespace_named_like_an_organisation_gets_neither_the_default_namespaces_model_nor_its_key():
    async def scenario():
        victim, attacker = await Recorder().start(), await Recorder().start()
        # The attacker's InferenceService is the older one, and open: it asks for no key, yet got the victim's.
        router = router_of([
            (isvc("meta-llama", "llama", "Llama-3.1-8B-Instruct", created="2025-01-01T00:00:00Z"), attacker.port),
            (isvc("default", "llama", "meta-llama/Llama-3.1-8B-Instruct", secret="keys", keys=(VICTIM_KEY,)),
             victim.port)])
        body = json.dumps({"model": "meta-llama/Llama-3.1-8B-Instruct", "prompt": "my secret prompt"})
        async with serving(router) as client:
            async with client.post("/v1/completions", data=body,
                                   headers={"Authorization": f"Bearer {VICTIM_KEY}", **CLIENT_HEADERS}) as resp:
                assert resp.status == 200
            async with client.get("/v1/models", headers={"Authorization": f"Bearer {VICTIM_KEY}"}) as resp:
                listed = {m["id"] for m in (await resp.json())["data"]}
        assert attacker.seen == []
        ((_, _, headers),) = victim.seen
        assert headers["Authorization"] == f"Bearer {VICTIM_KEY}" and headers["X-Kept"] == "1"
        assert not set(CLIENT_HEADERS) - {"X-Kept"} & set(headers)
        # No name reaches the shadowed one, so none is listed for it.
        assert listed == {"meta-llama/Llama-3.1-8B-Instruct"}
        await victim.runner.cleanup()
        await attacker.runner.cleanup()

    run(scenario())


def test_an_open_service_gets_no_credentials_at_all():
    async def scenario():
        engine = await Recorder().start()
        router = router_of([(isvc("default", "open", "m"), engine.port),
                            (isvc("team-b", "keyed", "k", secret="keys", keys=(VICTIM_KEY,)), engine.port)])
        async with serving(router) as client:
            # The client's key for team-b sent (by mistake, or by a client that sends it everywhere) to an open model.
            async with client.post("/v1/chat/completions", data=b'{"model": "m", "messages": []}',
                                   headers={"Authorization": f"Bearer {VICTIM_KEY}", **CLIENT_HEADERS}) as resp:
                assert resp.status == 200
        ((_, path, headers),) = engine.seen
        assert path == "/v1/chat/completions" and headers["X-Kept"] == "1"
        assert not ({"Authorization"} | set(CLIENT_HEADERS) - {"X-Kept"}) & set(headers)
        await engine.runner.cleanup()

    run(scenario())


def test_each_model_string_has_one_reading_and_no_namespace_takes_another_ones():
    class S(tuple):
        key = property(lambda self: self[0])
        served_name = property(lambda self: self[1])
        created = property(lambda self: self[2])

    default_org = S((("default", "a"), "meta-llama/L", 10))
    squatter = S((("meta-llama", "b"), "L", 1))
    team_a = S((("team-a", "x"), "x", 10))
    team_b = S((("team-b", "y"), "team-a/x", 1))  # a bare name that spells another namespace's qualified one
    adapter = S((("default", "a"), "z", 10))
    team_c = S((("team-c", "z"), "z", 1))
    names = naming.index([default_org, squatter, team_a, team_b, team_c])
    adapters = naming.index([adapter])
    for cluster_wide in (False, True):
        def resolve(model: str, cluster_wide: bool = cluster_wide):
            return naming.resolve(model, (names, adapters), "default", cluster_wide)
        assert resolve("meta-llama/L") is default_org
        assert resolve("team-a/x") is team_a  # cluster-wide or not: team-a's own name is team-a's
        assert resolve("z") is adapter  # the default namespace's adapter before team-c's served name
        assert resolve("team-c/z") is team_c
    assert naming.shadowed([default_org, squatter, team_a], "default") == {squatter.key: default_org}


def test_a_request_held_while_its_name_moves_to_another_service_is_checked_against_that_ones_keys():
    async def scenario():
        first, second = await Recorder().start(), await Recorder().start()
        table = EndpointTable(default_namespace="default")
        table.apply_service("ADDED", isvc("default", "one", "m"))  # open, no ready pod: the request waits
        table.synced = True
        router = Router(table, RouterConfig(queue_timeout=5))
        async with serving(router) as client:
            sent = asyncio.ensure_future(client.post("/v1/completions", data=b'{"model": "m", "prompt": "x"}',
                                                     headers={"Authorization": "Bearer someone-elses"}))
            await until("the request to be held", lambda: router.held() == {ServiceKey("default", "one"): 1})
            table.apply_service("DELETED", isvc("default", "one", "m"))
            table.apply_service("ADDED", isvc("default", "two", "m", secret="keys", keys=(VICTIM_KEY,)))
            table.apply_pod("ADDED", engine_pod("default", "two", second.port))
            resp = await sent
            assert resp.status == 404
            resp.release()
        assert second.seen == [] and first.seen == []
        await first.runner.cleanup()
        await second.runner.cleanup()

    run(scenario())


def test_upstream_headers_keep_only_what_is_not_a_credential():
    got = upstream_headers({"authorization": "Bearer k", "COOKIE": "c", "x-forwarded-proto": "https",
                            "Content-Type": "application/json", "Connection": "close"}, None)
    assert dict(got) == {"Content-Type": "application/json"}
    assert upstream_headers({"Authorization": "Bearer k"}, "Bearer k")["Authorization"] == "Bearer k"


# 2. routes ---------------------------------------------------------------------------------------

ADMIN = [("POST", "/v1/load_lora_adapter"), ("POST", "/v1/unload_lora_adapter"), ("POST", "/v1/sleep"),
         ("POST", "/v1/wake_up"), ("POST", "/v1/chat/completions/../../v1/load_lora_adapter"),
         ("POST", "/v1/chat%2F..%2F..%2Fv1%2Fload_lora_adapter"), ("POST", "/v1//load_lora_adapter"),
         ("POST", "/tokenize"), ("GET", "/v1/chat/completions"), ("PUT", "/v1/completions"), ("POST", "/v1/x/y")]


def test_only_the_engines_openai_routes_are_forwarded_and_anything_else_is_an_openai_404():
    async def scenario():
        engine = await Recorder().start()
        router = router_of([(isvc("default", "open", "m"), engine.port)])
        body = b'{"model": "m", "lora_name": "mine", "lora_path": "/tmp/evil", "prompt": "x"}'
        async with serving(router) as client:
            port = int(str(client._base_url).rsplit(":", 1)[1])
            answers = []
            for method, path in ADMIN:  # raw, so that no client library normalizes the path first
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"{method} {path} HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                             f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                data = await asyncio.wait_for(reader.read(), 5)
                writer.close()
                status = int(data.split(b" ", 2)[1])
                error = json.loads(data.split(b"\r\n\r\n", 1)[1])["error"]
                answers.append((status, error["type"], error["code"]))
            for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/responses"):
                async with client.post(path, data=body) as resp:
                    assert resp.status == 200, path
        assert answers == [(404, "invalid_request_error", "unknown_url")] * len(ADMIN)
        assert [(m, p) for m, p, _ in engine.seen] == [
            ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/v1/embeddings"),
            ("POST", "/v1/responses")]
        await engine.runner.cleanup()

    run(scenario())


# 3. the byte budget ------------------------------------------------------------------------------


def test_two_thousand_idle_uploads_from_one_address_leave_the_budget_to_everyone_else():
    # The audit's numbers, with the router's defaults (128 MiB buffered, 4,096 connections).
    async def scenario():
        engine = await Recorder().start()
        router = router_of([(isvc("default", "open", "m"), engine.port)], body_timeout=20)
        async with serving(router) as client:
            port = int(str(client._base_url).rsplit(":", 1)[1])
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: r\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 65536\r\n\r\n")
            idle = []
            for _ in range(2048):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head)
                idle.append((reader, writer))
            # The uploads fill their address's share first (on a busy machine the router reads 2,048 heads later),
            # then have half a second more to take more than it, which they must not.
            share = router.config.max_buffered_bytes * router.config.max_client_share
            await until("the uploads to fill their address's share", lambda: router.budget.held >= share)
            await asyncio.sleep(0.5)
            held = router.budget.held
            connector = aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))
            async with aiohttp.ClientSession(f"http://127.0.0.1:{port}", connector=connector) as other:
                async with other.post("/v1/completions", data=b'{"model": "m", "prompt": "x"}') as resp:
                    status = resp.status
            for _, writer in idle:
                writer.close()
        assert status == 200
        assert held <= router.config.max_buffered_bytes * router.config.max_client_share
        await engine.runner.cleanup()

    run(scenario())


def test_a_body_that_parses_into_far_more_than_its_bytes_is_refused_before_it_is_parsed():
    async def scenario():
        engine = await Recorder().start()
        router = router_of([(isvc("default", "open", "m"), engine.port)])
        units = (4 << 20) // 3 - 20  # just within --max-body-bytes (4 MiB)
        answers = []
        async with serving(router) as client:
            for body in (b'{"model": "m", "x": [' + b",".join([b"{}"] * units) + b"]}",
                         b"[" + b",".join([b"{}"] * units) + b"]",
                         b'{"model": "m", "x": [' + b",".join([b"1"] * 1_100_000) + b"]}",
                         b'{"model": "m", "x": ' + b"[" * 200 + b"]" * 200 + b"}"):
                async with client.post("/v1/completions", data=body) as resp:
                    answers.append((resp.status, (await resp.json())["error"]["message"]))
            assert router.budget.held == 0
        assert answers == [
            (413, "the request body holds more than 65536 JSON arrays and objects")] * 2 + [
            (413, "the request body holds more than 1048576 JSON values"),
            (400, "the request body nests JSON arrays and objects deeper than 128 levels")]
        assert engine.seen == []
        await engine.runner.cleanup()

    run(scenario())
