"""spec.adapters (LoRA) in the operator: the CRD field, a pod template that no adapter change
rolls, the pure load/unload plan (idempotent), status.adapters and AdaptersReady, and the adapter
loop against fake engine pods (loads on add, unloads on removal, a failed load reported while the
others load)."""
from __future__ import annotations

import asyncio
import base64

import aiohttp
import pydantic
import pytest
from aiohttp import web

from kaon_operator import api
from kaon_operator.children import pod_template
from kaon_operator.config import OperatorConfig
from kaon_operator.lora import adapter_pods, adapter_sync, adapters
from kaon_operator.records import Records
from kaon_operator.status import conditions
from kaon_operator.status.summaries import PodSummary


def spec_of(adapter_list, **extra) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "hf://org/base", "credentialsSecret": "creds"}, "adapters": adapter_list, **extra})


SQL = {"name": "sql", "uri": "s3://bucket/adapters/sql"}
CHAT = {"name": "chat", "uri": "hf://org/chat-lora"}
LOCAL = {"name": "local", "uri": "pvc://loras/local"}


@pytest.mark.parametrize("bad", [
    [{"name": "a/b", "uri": "hf://org/x"}],           # a `/` would clash with <namespace>/<name>
    [{"name": "a", "uri": "/abs/path"}],              # not a fetchable source
    [{"name": "a", "uri": "builtin://smollm2-135m-instruct"}],
    [{"name": "a", "uri": "s3://B/x"}],               # a bucket name the model's rules refuse
    [{"name": "a", "uri": "hf://org/x"}, {"name": "a", "uri": "hf://org/y"}],  # one name twice
])
def test_invalid_adapters_are_refused(bad):
    with pytest.raises(pydantic.ValidationError):
        spec_of(bad)


def test_the_crd_keys_adapters_by_name():
    from kaon_operator import crd
    node = crd.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    field = node["properties"]["adapters"]
    assert field["x-kubernetes-list-type"] == "map" and field["x-kubernetes-list-map-keys"] == ["name"]
    assert field["items"]["required"] == ["name", "uri"]


def test_adding_or_removing_an_adapter_does_not_change_the_pod():
    one = pod_template.pod_spec("svc", spec_of([SQL]))
    assert pod_template.pod_spec("svc", spec_of([SQL, CHAT])) == one
    assert pod_template.pod_spec("svc", spec_of([CHAT])) == one
    args = one["containers"][0]["args"]
    assert args[args.index("--max-loras") + 1] == "4" and "--lora-modules" not in args
    env = {e["name"]: e for e in one["containers"][0]["env"]}
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"]["name"] == "creds"  # the model's credentials
    assert "--max-loras" not in pod_template.pod_spec("svc", spec_of([]))["containers"][0]["args"]


def test_a_pvc_adapter_mounts_its_claim_once():
    pod = pod_template.pod_spec("svc", spec_of([LOCAL, {"name": "other", "uri": "pvc://loras/other"}]))
    claims = [v for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert [v["persistentVolumeClaim"]["claimName"] for v in claims] == ["loras"]
    assert adapters.desired(spec_of([LOCAL])) == {"local": "/mnt/adapters/loras/local"}
    same_claim = api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "pvc://models/base"}, "adapters": [{"name": "x", "uri": "pvc://models/loras/x"}]})
    assert adapters.desired(same_claim) == {"x": "/mnt/models/loras/x"}
    assert not [v for v in pod_template.pod_spec("svc", same_claim)["volumes"] if v["name"].startswith("kaon-adapt")]


def test_the_engine_reads_the_flags_the_operator_writes():
    from kaon_runtime.cli import build_parser
    args = pod_template.engine_args("svc", spec_of([SQL], engine={"maxLoras": 2, "maxLoraRank": 32}))
    parsed = build_parser().parse_args(args[1:])
    assert (parsed.max_loras, parsed.max_lora_rank) == (2, 32)


def apply(pods: dict, actions: list[adapters.Action]) -> dict:
    out = {pod: dict(have) for pod, have in pods.items()}
    for a in actions:
        if a.op == "load":
            out[a.pod][a.name] = a.path
        else:
            out[a.pod].pop(a.name, None)
    return out


def test_the_plan_loads_unloads_and_is_idempotent():
    want = {"sql": "s3://b/sql", "chat": "hf://o/chat"}
    pods = {"p0": {}, "p1": {"sql": "s3://b/sql", "old": "s3://b/old"}, "p2": {"chat": "hf://o/chat-v1"}}
    actions = adapters.plan(want, pods)
    assert actions[:3] == [adapters.Action("p1", "unload", "old"), adapters.Action("p2", "unload", "chat")] + [
        adapters.Action("p0", "load", "chat", "hf://o/chat")]
    done = apply(pods, actions)
    assert all(have == want for have in done.values())
    assert adapters.plan(want, done) == []  # idempotent: nothing more to do
    assert adapters.plan(want, pods, skip=[("p0", "sql")]) == [a for a in actions if a[:3] != ("p0", "load", "sql")]


def test_status_and_condition_name_the_failed_adapter():
    want = {"sql": "s3://b/sql", "chat": "hf://o/chat"}
    pods = {"p0": {"chat": "hf://o/chat"}, "p1": {"chat": "hf://o/chat"}}
    failures = {"sql": "fetch failed: NoSuchKey"}
    assert adapters.status(want, pods, failures) == [
        {"name": "chat", "pods": ["p0", "p1"]}, {"name": "sql", "pods": [], "failure": "fetch failed: NoSuchKey"}]
    cond = conditions.adapters_condition(want, pods, failures)
    assert cond["status"] == "False" and "sql: fetch failed" in cond["message"]
    assert conditions.adapters_condition(want, pods, {})["reason"] == "Loading"
    assert conditions.adapters_condition({"chat": "hf://o/chat"}, pods, {})["status"] == "True"
    assert conditions.adapters_condition({}, pods, {}) is None
    assert conditions.adapters_condition(want, {}, {})["status"] == "Unknown"  # no ready pod: not "loaded on 0 pods"


def test_held_reads_the_adapters_of_a_models_reply():
    reply = {"object": "list", "data": [{"id": "base", "parent": None, "root": "/m"},
                                        {"id": "sql", "parent": "base", "root": "s3://b/sql"}]}
    assert adapters.held(reply) == {"sql": "s3://b/sql"}
    assert adapters.held({"error": {}}) == {}


# The loop against fake engine pods ----------------------------------------------------------


class FakeEngine:
    """An engine's adapter endpoints: loads of `broken` URIs fail with a reason, as a failed fetch does."""

    def __init__(self, key: str | None = None, broken: tuple[str, ...] = ()):
        self.adapters: dict[str, str] = {}
        self.key, self.broken, self.calls = key, broken, []
        self.app = web.Application()
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_post("/v1/load_lora_adapter", self.load)
        self.app.router.add_post("/v1/unload_lora_adapter", self.unload)

    def _denied(self, request) -> web.Response | None:
        if self.key and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return None

    async def models(self, request):
        return self._denied(request) or web.json_response({"data": [{"id": "base", "parent": None}] + [
            {"id": n, "parent": "base", "root": p} for n, p in self.adapters.items()]})

    async def load(self, request):
        if (denied := self._denied(request)) is not None:
            return denied
        body = await request.json()
        self.calls.append(("load", body["lora_name"]))
        if body["lora_path"] in self.broken:
            return web.json_response({"error": {"message": "ModelNotFound: no such key"}}, status=400)
        self.adapters[body["lora_name"]] = body["lora_path"]
        return web.Response(text="Success")

    async def unload(self, request):
        if (denied := self._denied(request)) is not None:
            return denied
        body = await request.json()
        self.calls.append(("unload", body["lora_name"]))
        self.adapters.pop(body["lora_name"], None)
        return web.Response(text="Success")


class FakeCaches:
    def __init__(self, body, pods):
        self.body, self._pods = body, pods

    def all_inference_services(self):
        return [(("ns", "svc"), self.body)]

    def pods(self, key):
        return self._pods

    def adapter_pods(self, key):
        return self._pods

    def inference_service(self, key):
        return self.body


class FakeKube:
    def __init__(self, secret=None):
        self.patches, self.secret, self.conditions = [], secret, []

    def patch_status(self, namespace, name, patch):
        self.patches.append(patch)

    def secret_data(self, namespace, name, owner_uid=None):
        return self.secret

    def set_pod_condition(self, namespace, name, condition):
        self.conditions.append((name, condition))


class FakeCtx:
    def __init__(self, body, pods, secret=None):
        self.caches, self.kube, self.events, self.records = FakeCaches(body, pods), FakeKube(secret), [], Records()
        self.config = OperatorConfig()

    def post(self, body, events):
        self.events += events


async def _one_round(ctx, runners) -> None:
    """One round of the adapter loop over ctx's pods, then the fake engines' servers stopped."""
    loop = adapter_sync.AdapterLoop(ctx, url_of=lambda pod: f"http://{pod.ip}")  # type: ignore[arg-type]
    try:
        async with aiohttp.ClientSession() as session:
            await loop.tick_all(session)
    finally:
        for runner in runners:
            await runner.cleanup()


async def _serve(engines, port_holder):
    runners = []
    for engine in engines:
        runner = web.AppRunner(engine.app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port_holder.append(runner.addresses[0][1])
    return runners


def test_the_loop_loads_added_and_unloads_removed_adapters(monkeypatch):
    changed = []
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: changed.append(c))

    async def scenario():
        engines = [FakeEngine(key="k1"), FakeEngine(key="k1", broken=("hf://org/broken",))]
        ports: list[int] = []
        runners = await _serve(engines, ports)
        pods = [PodSummary(f"p{i}", ip=f"127.0.0.1:{port}", ready=True) for i, port in enumerate(ports)]
        body = {"metadata": {"namespace": "ns", "name": "svc"},
                "spec": {"model": {"uri": "hf://org/base"}, "auth": {"apiKeySecret": "keys"},
                         "adapters": [SQL, {"name": "broken", "uri": "hf://org/broken"}]}}
        ctx = FakeCtx(body, pods, secret={"a": base64.b64encode(b"k1").decode()})
        loop = adapter_sync.AdapterLoop(ctx, url_of=lambda pod: f"http://{pod.ip}")  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as session:
                await loop.tick_all(session)
                assert engines[0].adapters == {"sql": SQL["uri"], "broken": "hf://org/broken"}
                assert engines[1].adapters == {"sql": SQL["uri"]}  # the base and sql serve; broken is reported
                assert [e.reason for e in ctx.events] == ["AdapterLoadFailed"] and "broken" in ctx.events[0].message
                assert changed[-1]["status"] == "False" and "broken" in changed[-1]["message"]
                assert ctx.kube.patches[-1]["adapters"][0] == {"name": "broken", "pods": ["p0"],
                                                               "failure": "ModelNotFound: no such key"}
                calls = len(engines[1].calls)
                await loop.tick_all(session)  # the failed load waits RETRY_SECONDS; nothing else to do
                assert len(engines[1].calls) == calls and len(ctx.events) == 1
                body["spec"]["adapters"] = [SQL, CHAT]  # broken removed, chat added: no restart, just loads
                await loop.tick_all(session)
                assert engines[0].adapters == engines[1].adapters == {"sql": SQL["uri"], "chat": CHAT["uri"]}
                assert changed[-1]["status"] == "True"
                assert ctx.kube.patches[-1]["adapters"] == [{"name": "chat", "pods": ["p0", "p1"]},
                                                            {"name": "sql", "pods": ["p0", "p1"]}]
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())


# A new pod turns Ready only with its adapters (issue 48, item 2) ----------------------------


def test_a_pod_with_adapters_waits_for_them_behind_a_readiness_gate():
    from kaon_operator.children import leaderworkerset
    from kaon_operator.lora import adapter_pods
    pod = pod_template.pod_spec("svc", spec_of([SQL]))
    assert pod["readinessGates"] == [{"conditionType": adapter_pods.ADAPTERS_GATE}]
    assert adapter_pods.ADAPTERS_GATE == "kaon.dev/adapters-loaded"
    assert "readinessGates" not in pod_template.pod_spec("svc", spec_of([]))
    group = leaderworkerset.manifest({"name": "svc"}, "svc", spec_of(
        [SQL], engine={"nodesPerReplica": 2, "pipelineParallelSize": 2}))["spec"]["leaderWorkerTemplate"]
    assert "readinessGates" in group["leaderTemplate"]["spec"]
    assert "readinessGates" not in group["workerTemplate"]["spec"]  # workers serve no API, hold no adapter


def test_the_gate_is_set_only_once_the_new_pod_holds_its_adapters(monkeypatch):
    """A scale-up's pod: its engine answers (containers ready) but the gate holds it out of the
    Service and the router. The loop loads the adapters on it, then sets the gate; a load that fails
    sets it too (the base serves, the failure is reported), so a broken adapter stalls no rollout."""
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)
    gate = "kaon.dev/adapters-loaded"  # the pod template's readinessGates entry (the test above)

    async def scenario():
        engines = [FakeEngine(), FakeEngine(broken=("hf://org/broken",)), FakeEngine()]
        ports: list[int] = []
        runners = await _serve(engines, ports)
        pods = [PodSummary("new", ip=f"127.0.0.1:{ports[0]}", containers_ready=True, gates_pending=frozenset({gate})),
                PodSummary("bad", ip=f"127.0.0.1:{ports[1]}", containers_ready=True, gates_pending=frozenset({gate})),
                PodSummary("old", ip=f"127.0.0.1:{ports[2]}", ready=True, containers_ready=True)]
        body = {"metadata": {"namespace": "ns", "name": "svc"},
                "spec": {"model": {"uri": "hf://org/base"}, "adapters": [SQL, {"name": "broken", "uri": "hf://org/broken"}]}}
        ctx = FakeCtx(body, pods)
        await _one_round(ctx, runners)
        assert engines[0].adapters == {"sql": SQL["uri"], "broken": "hf://org/broken"}
        set_on = {name: c for name, c in ctx.kube.conditions}
        assert set(set_on) == {"new", "bad"}  # "old" has no gate pending: nothing to set
        assert set_on["new"]["type"] == gate and set_on["new"]["status"] == "True"
        assert set_on["new"]["reason"] == "AdaptersLoaded"
        assert set_on["bad"]["reason"] == "AdaptersFailed" and "broken" in set_on["bad"]["message"]

    asyncio.run(scenario())


def test_the_loop_loads_the_adapters_on_the_prefill_pool_too(monkeypatch):
    """spec.prefill: a LoRA prompt's K/V is computed on a prefill pod with its adapter, so the prefill pods
    (kopf's prefill_pods index) hold spec.adapters as the decode pods do, and are gated on them the same way."""
    from kaon_operator.caches import Caches
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)
    gate = "kaon.dev/adapters-loaded"

    async def scenario():
        engines = [FakeEngine(), FakeEngine()]
        ports: list[int] = []
        runners = await _serve(engines, ports)
        body = {"metadata": {"namespace": "ns", "name": "svc"},
                "spec": {"model": {"uri": "hf://org/base"}, "adapters": [SQL], "prefill": {"replicas": 1}}}
        ctx = FakeCtx(body, [])
        ctx.caches = Caches(inference_services={("ns", "svc"): [body]},  # type: ignore[assignment]
                            engine_pods={("ns", "svc"): [PodSummary("decode", ip=f"127.0.0.1:{ports[0]}", ready=True)]},
                            prefill_pods={("ns", "svc"): [PodSummary("prefill", ip=f"127.0.0.1:{ports[1]}",
                                                                     containers_ready=True,
                                                                     gates_pending=frozenset({gate}))]})
        await _one_round(ctx, runners)
        assert engines[0].adapters == engines[1].adapters == {"sql": SQL["uri"]}
        assert [(name, c["status"]) for name, c in ctx.kube.conditions] == [("prefill", "True")]

    asyncio.run(scenario())


def test_the_gate_waits_while_an_adapter_is_missing():
    from kaon_operator.lora import adapters as plan
    want = {"sql": "s3://b/sql", "chat": "hf://o/chat"}
    assert not plan.settled(want, {"sql": "s3://b/sql"}, [])
    assert plan.settled(want, {"sql": "s3://b/sql"}, ["chat"])
    assert not plan.settled(want, {"sql": "s3://b/other", "chat": "hf://o/chat"}, [])
    assert plan.settled({}, {}, [])


# Only the operator changes adapters (issue 48, item 2) --------------------------------------


def test_the_engine_takes_adapter_changes_only_with_the_services_admin_key():
    """The pod runs with --enable-runtime-lora and KAON_ADMIN_KEY from `<name>-admin-key`, after the
    spec's own env (a KAON_ADMIN_KEY there does not replace it); without adapters, neither."""
    spec = spec_of([SQL], engine={"env": [{"name": "KAON_ADMIN_KEY", "value": "chosen-by-the-tenant"}]})
    engine = pod_template.pod_spec("svc", spec)["containers"][0]
    assert "--enable-runtime-lora" in engine["args"]
    assert engine["args"][engine["args"].index("--max-cpu-loras") + 1] == str(api.MAX_ADAPTERS)
    keys = [e for e in engine["env"] if e["name"] == "KAON_ADMIN_KEY"]
    assert keys == [{"name": "KAON_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": "svc-admin-key", "key": "key"}}}]
    plain = pod_template.pod_spec("svc", spec_of([]))["containers"][0]
    assert "--enable-runtime-lora" not in plain["args"]
    assert not [e for e in plain.get("env") or () if e["name"] == "KAON_ADMIN_KEY"]
    secret = adapter_pods.admin_key_secret({"namespace": "ns", "ownerReferences": []}, "svc", "k")
    assert secret["metadata"]["name"] == "svc-admin-key" and secret["stringData"] == {"key": "k"}


class KeyedKube(FakeKube):
    """spec.auth's serving keys in "keys"; the admin key in the service's own "svc-admin-key" (uid u1)."""

    def secret_data(self, namespace, name, owner_uid=None):
        if name == "keys":
            return {"a": base64.b64encode(b"serving").decode()}
        if name == "svc-admin-key" and owner_uid == "u1":
            return {"key": base64.b64encode(b"admin").decode()}
        return None


def test_the_loop_sends_the_admin_key_not_the_serving_key(monkeypatch):
    """It failed before: the loop sent spec.auth's serving key, which the engine no longer takes."""
    monkeypatch.setattr(adapter_sync.status_sync, "adapters_changed", lambda ctx, key, c: None)

    async def scenario():
        engine = FakeEngine(key="admin")
        ports: list[int] = []
        runners = await _serve([engine], ports)
        body = {"metadata": {"namespace": "ns", "name": "svc", "uid": "u1"},
                "spec": {"model": {"uri": "hf://org/base"}, "auth": {"apiKeySecret": "keys"}, "adapters": [SQL]}}
        ctx = FakeCtx(body, [PodSummary("p0", ip=f"127.0.0.1:{ports[0]}", ready=True)])
        ctx.kube = KeyedKube()
        loop = adapter_sync.AdapterLoop(ctx, url_of=lambda pod: f"http://{pod.ip}")  # type: ignore[arg-type]
        try:
            async with aiohttp.ClientSession() as session:
                await loop.tick_all(session)
                assert engine.adapters == {"sql": SQL["uri"]}
                body["metadata"]["uid"] = "another"  # a Secret the service does not control is not read
                engine.adapters.clear()
                await loop.tick_all(session)
                assert engine.adapters == {}
        finally:
            for runner in runners:
                await runner.cleanup()

    asyncio.run(scenario())
