"""Tenancy: the addressing scheme (naming.py), the router resolving `namespace/name` and bare
names per namespace with a real aiohttp router in front of a recording engine, /v1/models, the
name-conflict rule, and the router's namespace-scoped RBAC in the chart."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import aiohttp

from kaon_operator import naming
from kaon_operator.router.endpoints import EndpointTable, ServiceKey
from support.tenancy import Recorder, engine_pod, isvc, serve


@dataclass(frozen=True)
class S:
    key: tuple[str, str]
    served_name: str
    created: int


def names(*services: S) -> naming.Names:
    return naming.index(services)


# the addressing scheme, pure -----------------------------------------------------------------

def test_bare_names_resolve_in_the_default_namespace_only_unless_cluster_wide():
    mine, theirs = S(("default", "llama"), "llama-3", 1), S(("team-b", "llama"), "qwen", 2)
    idx = names(mine, theirs)
    assert naming.resolve("llama-3", idx, "default", False) is mine
    assert naming.resolve("qwen", idx, "default", False) is None  # another namespace's: not by a bare name
    assert naming.resolve("team-b/qwen", idx, "default", False) is theirs
    assert naming.resolve("default/llama-3", idx, "default", False) is mine
    assert naming.resolve("team-b/llama-3", idx, "default", False) is None
    assert naming.resolve("qwen", idx, "default", True) is theirs  # the admin allowed cluster-wide names
    assert naming.resolve("qwen", idx, "team-b", False) is theirs  # a router whose default is team-b


def test_the_default_namespace_wins_a_bare_name_then_the_oldest():
    old, young, local = S(("a", "x"), "m", 1), S(("b", "x"), "m", 2), S(("default", "x"), "m", 3)
    assert naming.resolve("m", names(old, young), "default", True) is old
    assert naming.resolve("m", names(old, young, local), "default", True) is local


def test_a_served_name_with_a_slash_still_resolves():
    hf = S(("default", "qwen"), "Qwen/Qwen2.5-7B", 1)
    idx = names(hf)
    assert naming.resolve("Qwen/Qwen2.5-7B", idx, "default", False) is hf  # no namespace "Qwen" serves it
    assert naming.resolve("default/Qwen/Qwen2.5-7B", idx, "default", False) is hf


def test_a_conflict_is_the_later_one_of_a_namespace_and_the_older_keeps_the_name():
    older, later, elsewhere = S(("a", "one"), "m", 1), S(("a", "two"), "m", 2), S(("b", "three"), "m", 0)
    assert naming.conflicts([later, older, elsewhere]) == {("a", "two"): older}
    assert naming.resolve("a/m", names(later, older), "a", False) is older
    same_second = S(("a", "zzz"), "m", 1)  # created in the same second: the name breaks the tie
    assert naming.conflicts([same_second, older]) == {("a", "zzz"): older}
    assert naming.conflicts([older, elsewhere]) == {}


def test_addressable_lists_each_service_once_by_its_shortest_name():
    local, other, shadowed = S(("default", "x"), "m", 1), S(("b", "y"), "n", 2), S(("default", "z"), "m", 3)
    idx = names(local, other, shadowed)
    assert [(n, s.key) for n, s in naming.addressable(idx, "default", False)] == [
        ("b/n", ("b", "y")), ("m", ("default", "x"))]
    assert [n for n, _ in naming.addressable(idx, "default", True)] == ["m", "n"]


# the router, with a recording engine ---------------------------------------------------------------


def test_router_resolves_per_namespace_and_rewrites_a_qualified_model():
    async def scenario():
        mine, theirs = await Recorder().start(), await Recorder().start()
        table = EndpointTable()  # the CLI's defaults: default namespace `default`, no cluster-wide names
        table.replace_services(None, [isvc("default", "chat", "smollm2"), isvc("team-b", "chat", "private")])
        table.apply_pod("ADDED", engine_pod("default", "chat", mine.port))
        table.apply_pod("ADDED", engine_pod("team-b", "chat", theirs.port))
        table.synced = True
        runner, url = await serve(table)
        out = {}
        try:
            async with aiohttp.ClientSession() as client:
                for label, model in [("bare", "smollm2"), ("cross", "private"), ("qualified", "team-b/private"),
                                     ("wrong-ns", "default/private")]:
                    body = json.dumps({"model": model, "prompt": "hé", "max_tokens": 1}).encode()
                    async with client.post(f"{url}/v1/completions", data=body) as resp:
                        out[label] = (resp.status, await resp.json())
                async with client.get(f"{url}/v1/models") as resp:
                    out["models"] = [m["id"] for m in (await resp.json())["data"]]
        finally:
            await runner.cleanup()
            await mine.stop()
            await theirs.stop()
        return out, mine.seen, theirs.seen

    out, mine, theirs = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert out["bare"][0] == 200
    for refused in ("cross", "wrong-ns"):
        status, body = out[refused]
        assert status == 404 and body["error"]["code"] == "model_not_found" and body["error"]["param"] == "model"
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert out["qualified"][0] == 200
    assert len(mine) == 1 and len(theirs) == 1
    assert json.loads(mine[0][0])["model"] == "smollm2"  # a bare name passes unchanged
    sent = json.loads(theirs[0][0])
    assert sent == {"model": "private", "prompt": "hé", "max_tokens": 1}  # the engine's own name
    assert out["models"] == ["smollm2", "team-b/private"]


def test_a_later_service_with_a_taken_name_gets_no_traffic():
    table = EndpointTable(default_namespace="a")
    table.replace_services(None, [isvc("a", "old", "m", "2026-01-01T00:00:00Z"),
                                  isvc("a", "new", "m", "2026-01-02T00:00:00Z")])
    assert table.resolve("m") == ServiceKey("a", "old") and table.resolve("a/m") == ServiceKey("a", "old")
    assert [s.key for s in table.services()] == [ServiceKey("a", "old")]
    table.apply_service("DELETED", isvc("a", "old", "m"))
    assert table.resolve("m") == ServiceKey("a", "new")  # the name passes to the one left


# the chart ------------------------------------------------------------------------------------


# the operator's NameConflict condition, pure ----------------------------------------------------------

