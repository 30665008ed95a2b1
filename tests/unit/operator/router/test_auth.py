"""API keys: the engine's key file (kaon serve --api-key-file), the digests the operator publishes
from spec.auth's Secret (key_digests.py) and the router's check of them (router/auth.py),
unit-tested; one real `kaon serve` for rotation without a restart."""
from __future__ import annotations

import asyncio
import base64
import gc
import hashlib
import types

import aiohttp
import pytest

from kaon_operator import key_digests
from kaon_operator.records import Records
from kaon_operator.router import auth
from kaon_operator.router.endpoints import EndpointTable, ServiceKey
from kaon_runtime.server import keys as engine_keys
from kaon_runtime.server.keys import ApiKeys, matches, read_keys
from support.secret_volume import secret_volume
from support.tenancy import Recorder, engine_pod, isvc, serve


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# ---- engine: the key file ----------------------------------------------------------------------


def test_read_keys_from_a_file_and_a_secret_volume(tmp_path):
    file = tmp_path / "keys.txt"
    file.write_text("alpha\n\n  beta  \n")
    assert read_keys(file) == (b"alpha", b"beta")
    volume = tmp_path / "secret"
    volume.mkdir()
    secret_volume(volume, {"ci": "k-ci\n", "alice": "k-alice"}, "1")
    assert sorted(read_keys(volume)) == [b"k-alice", b"k-ci"]  # not ..data, not the timestamped dir


def test_matches_compares_every_key():
    assert matches(b"b", (b"a", b"b", b"c"))
    assert not matches(b"", (b"a",)) and not matches(b"a", ())
    assert not matches(b"ab", (b"a",)) and not matches(b"a", (b"ab",))


def test_rotation_is_seen_without_a_restart(tmp_path):
    volume = tmp_path / "secret"
    volume.mkdir()
    secret_volume(volume, {"key": "old"}, "1")
    clock = Clock()
    keys = ApiKeys(key_file=volume, clock=clock)
    assert keys.enabled and keys.accepts("old") and not keys.accepts("new")
    secret_volume(volume, {"key": "new"}, "2")
    clock.now += engine_keys.RECHECK_S
    assert keys.accepts("new") and not keys.accepts("old")


@pytest.mark.parametrize("state", ["missing", "empty-dir", "blank-file"])
def test_missing_or_empty_key_file_fails_closed(tmp_path, state):
    path = tmp_path / "keys"
    if state == "empty-dir":
        path.mkdir()
    elif state == "blank-file":
        path.write_text("\n \n")
    keys = ApiKeys(key_file=path)
    assert keys.enabled and not keys.accepts("") and not keys.accepts("anything")


def test_no_key_means_no_auth_and_a_fixed_key_still_works(tmp_path):
    assert not ApiKeys().enabled
    file = tmp_path / "k"
    file.write_text("from-file")
    both = ApiKeys("fixed", file)
    assert both.accepts("fixed") and both.accepts("from-file") and not both.accepts("other")


# ---- router: per-InferenceService keys from Secrets ------------------------------------------------


def b64(value: str) -> str:
    return base64.b64encode(value.encode()).decode()


def secret(name: str, namespace: str = "default", **data: str) -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "data": {k: b64(v) for k, v in data.items()}}


def test_bearer_and_accepted():
    digests = (auth.digest(b"k1"), auth.digest(b"k2"))
    assert auth.bearer("Bearer k1") == b"k1" and auth.bearer("bearer  k1 ") == b"k1"
    assert auth.bearer("Basic k1") is None and auth.bearer(None) is None and auth.bearer("Bearer ") is None
    assert auth.accepted(b"k2", digests) and not auth.accepted(b"k3", digests) and not auth.accepted(None, digests)
    assert not auth.accepted(b"k1", ())


def test_the_operator_publishes_digests_not_keys():
    data = secret("keys", alice="sk-alice\n", empty="", bob="sk-bob")["data"]
    published = key_digests.published("keys", data)
    # Trimmed, the empty value dropped, sorted: the same keys publish the same list.
    assert published == {"apiKeySecret": "keys", "keyDigests": sorted(
        hashlib.sha256(k).hexdigest() for k in (b"sk-alice", b"sk-bob"))}
    assert "sk-alice" not in repr(published) and b64("sk-alice") not in repr(published)
    assert key_digests.published("keys", None) == {"apiKeySecret": "keys", "keyDigests": []}  # missing: closed
    assert key_digests.secret_name({}) is None and key_digests.secret_name({"auth": {"apiKeySecret": "k"}}) == "k"
    assert key_digests.secret_name({"auth": {"apiKeySecret": "Not_Valid"}}) == ""  # no Secret read, closed


class FakeKube:
    def __init__(self, secrets: dict):
        self.secrets, self.patches = secrets, []

    def secret_data(self, namespace: str, name: str):
        return self.secrets.get((namespace, name))

    def patch_status(self, namespace: str, name: str, status: dict):
        self.patches.append((namespace, name, status))
        return {}


def test_publish_writes_status_auth_only_when_it_changed_and_warns_of_a_missing_secret():
    from types import SimpleNamespace

    kube = FakeKube({("ns", "keys"): secret("keys", "ns", a="key-one")["data"]})
    events = []
    ctx = SimpleNamespace(kube=kube, post=lambda body, specs: events.extend(specs), records=Records())
    body = isvc("ns", "svc", secret="keys")
    key_digests.publish(ctx, ("ns", "svc"), body)
    key_digests.publish(ctx, ("ns", "svc"), body)  # unchanged: no second write
    assert kube.patches == [("ns", "svc", {"auth": {"apiKeySecret": "keys", "keyDigests": [
        hashlib.sha256(b"key-one").hexdigest()]}})] and events == []
    kube.secrets[("ns", "keys")] = secret("keys", "ns", b="key-two")["data"]  # rotated
    key_digests.publish(ctx, ("ns", "svc"), body)
    assert kube.patches[-1][2]["auth"]["keyDigests"] == [hashlib.sha256(b"key-two").hexdigest()]
    del kube.secrets[("ns", "keys")]  # deleted: nothing published, a Warning Event
    key_digests.publish(ctx, ("ns", "svc"), body)
    assert kube.patches[-1][2] == {"auth": {"apiKeySecret": "keys", "keyDigests": []}}
    assert [(e.type, e.reason) for e in events] == [("Warning", "NoApiKeys")]
    key_digests.publish(ctx, ("ns", "svc"), isvc("ns", "svc"))  # spec.auth removed: status.auth too
    assert kube.patches[-1][2] == {"auth": None} and len(kube.patches) == 4


def reachable(root: object, depth: int = 10) -> list[object]:
    """Every object `root` holds, however deep (to `depth`), through the collector's view of references: the same for
    the source's classes and the compiled ones (router/compiled.py), which have no __dict__."""
    found, seen, level = [], {id(root)}, [root]
    for _ in range(depth):
        nxt = []
        for obj in level:
            for ref in gc.get_referents(obj):
                if id(ref) in seen or isinstance(ref, type | types.ModuleType | types.FunctionType):
                    continue
                seen.add(id(ref))
                found.append(ref)
                nxt.append(ref)
        level = nxt
    return found


def test_the_table_keeps_digests_not_keys_and_only_those_published_for_the_named_secret():
    table = EndpointTable()
    table.replace_services(None, [isvc("default", "chat", "m", secret="keys", keys=("sk-alice",)),
                                  isvc("default", "moved", "n", secret="new-keys", keys=("sk-old",),
                                       published_for="old-keys")])
    assert table.api_keys(ServiceKey("default", "chat")) == (hashlib.sha256(b"sk-alice").digest(),)
    assert not [o for o in reachable(table) if isinstance(o, str | bytes) and "sk-alice" in str(o)]
    # spec.auth names another Secret than the digests were published for: closed until republished.
    assert table.api_keys(ServiceKey("default", "moved")) == ()
    table.apply_service("MODIFIED", isvc("default", "chat", "m", secret="keys", keys=("sk-alice",)) | {
        "status": {"auth": {"apiKeySecret": "keys", "keyDigests": ["not hex", "ab"]}}})
    assert table.api_keys(ServiceKey("default", "chat")) == ()  # unreadable digests: closed, no error


def test_a_body_is_worth_reading_by_its_key_only_while_every_service_requires_one():
    """may_send_body follows the services as they come and go (the table notes key_required_everywhere
    at each change, not at each request)."""
    table = EndpointTable()
    table.synced = True
    assert auth.may_send_body(table, None)  # no service yet: read, then answered 404
    table.apply_service("ADDED", isvc("default", "chat", "m", secret="keys", keys=("sk-alice",)))
    assert not auth.may_send_body(table, None) and not auth.may_send_body(table, "Bearer sk-bob")
    assert auth.may_send_body(table, "Bearer sk-alice")
    table.apply_service("ADDED", isvc("default", "open", "o"))
    assert auth.may_send_body(table, None)  # an open service may be named in the body
    table.apply_service("DELETED", isvc("default", "open", "o"))
    assert not auth.may_send_body(table, None)
    table.replace_services(None, [])
    assert auth.may_send_body(table, None)


def test_router_checks_keys_per_service_rotates_and_fails_closed():
    async def scenario():
        engine = await Recorder().start()
        table = EndpointTable()
        keys = ("key-one", "key-two")  # the digests the operator published from the Secret "keys"
        table.replace_services(None, [isvc("default", "locked", "secure", secret="keys", keys=keys),
                                      isvc("default", "open", "public"),
                                      isvc("default", "cold", "asleep", secret="keys", keys=keys),  # no pod: held
                                      isvc("default", "lost", "orphan", secret="missing")])
        table.apply_pod("ADDED", engine_pod("default", "locked", engine.port))
        table.apply_pod("ADDED", engine_pod("default", "open", engine.port))
        table.synced = True
        runner, url = await serve(table)
        out = {}

        async def post(label: str, model: str, key: str | None) -> None:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            async with client.post(f"{url}/v1/completions", json={"model": model, "prompt": "x"},
                                   headers=headers) as resp:
                out[label] = (resp.status, await resp.json())

        try:
            async with aiohttp.ClientSession() as client:
                await post("none", "secure", None)
                await post("wrong", "secure", "key-three")
                await post("one", "secure", "key-one")
                await post("two", "secure", "key-two")
                await post("open", "public", None)
                await post("cold", "asleep", None)  # refused at once, not held for a replica
                await post("orphan", "orphan", "key-one")
                await post("unknown", "nowhere", None)
                async with client.get(f"{url}/v1/models") as resp:
                    out["models-anonymous"] = [m["id"] for m in (await resp.json())["data"]]
                async with client.get(f"{url}/v1/models", headers={"Authorization": "Bearer key-one"}) as resp:
                    out["models-keyed"] = [m["id"] for m in (await resp.json())["data"]]
                # Rotation: the Secret is edited, the operator publishes the new digests (a watch
                # event of the InferenceService), the router is not restarted.
                table.apply_service("MODIFIED", isvc("default", "locked", "secure", secret="keys", keys=("key-new",)))
                await post("old-after", "secure", "key-one")
                await post("new-after", "secure", "key-new")
                table.apply_service("MODIFIED", isvc("default", "locked", "secure", secret="keys", keys=()))  # emptied
                await post("emptied", "secure", "key-new")
                table.apply_service("MODIFIED", isvc("default", "locked", "secure", secret="keys"))  # none published
                await post("deleted", "secure", "key-new")
        finally:
            await runner.cleanup()
            await engine.stop()
        return out, engine.seen

    out, seen = asyncio.run(asyncio.wait_for(scenario(), 30))
    # Without one of its keys a protected service is indistinguishable from none (so names cannot be
    # probed), and so is one whose Secret is missing or empty (closed, never open).
    for label in ("none", "wrong", "cold", "old-after", "orphan", "emptied", "deleted"):
        status, body = out[label]
        assert status == 404 and body["error"]["code"] == "model_not_found", label
    unknown = out["unknown"]
    assert unknown[0] == 404 and unknown[1]["error"]["message"] == \
        out["none"][1]["error"]["message"].replace("secure", "nowhere")
    for label in ("one", "two", "open", "new-after"):
        assert out[label][0] == 200, (label, out[label])
    # The client's Authorization reaches the engine, which checks the same key (pod-IP access needs it too).
    assert [h for _, h in seen] == ["Bearer key-one", "Bearer key-two", None, "Bearer key-new"]
    assert out["models-anonymous"] == ["public"]
    assert out["models-keyed"] == ["asleep", "public", "secure"]


def test_engine_pods_of_a_protected_service_mount_the_secret_and_require_its_keys():
    from kaon_operator import api
    from kaon_operator.children import pod_template, resources

    owner = resources.Owner("chat", "default", "uid")
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "/m"}, "auth": {"apiKeySecret": "keys"}})
    pod = resources.deployment(owner, spec)["spec"]["template"]["spec"]
    (engine,) = pod["containers"]
    assert engine["args"][engine["args"].index("--api-key-file") + 1] == pod_template.API_KEYS_MOUNT
    assert {"name": "api-keys", "secret": {"secretName": "keys", "defaultMode": 0o440}} in pod["volumes"]
    assert {"name": "api-keys", "mountPath": pod_template.API_KEYS_MOUNT, "readOnly": True} in engine["volumeMounts"]
    # The probes stay open: /health and /ready need no key.
    assert {engine[p]["httpGet"]["path"] for p in ("startupProbe", "livenessProbe", "readinessProbe")} <= {
        "/health", "/ready"}
    open_spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "/m"}})
    plain = resources.deployment(owner, open_spec)["spec"]["template"]["spec"]
    assert "--api-key-file" not in plain["containers"][0]["args"]
    assert all(v["name"] != "api-keys" for v in plain["volumes"])


def test_the_router_watches_no_secret_and_the_operator_reads_only_opaque_ones():
    from unittest.mock import MagicMock

    from kaon_operator.kube import Kube
    from kaon_operator.router.watch import ApiServer, Watcher

    server = ApiServer("https://127.0.0.1:1", None, lambda: None)
    assert {k.plural for k in Watcher(server, EndpointTable()).kinds} == {"pods", "inferenceservices"}
    kube = Kube.__new__(Kube)
    kube.core = MagicMock()
    kube.core.read_namespaced_secret.return_value = MagicMock(type="kubernetes.io/service-account-token",
                                                              data={"token": b64("t")})
    assert kube.secret_data("ns", "sa-token") is None  # never read as API keys
    kube.core.read_namespaced_secret.return_value = MagicMock(type="Opaque", data={"k": b64("key")})
    assert kube.secret_data("ns", "keys") == {"k": b64("key")}


def test_the_security_docs_auth_example_is_a_valid_spec():
    import re
    from pathlib import Path

    import yaml

    from kaon_operator import api

    text = (Path(__file__).resolve().parents[4] / "docs" / "security.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (example,) = [b for b in blocks if "auth" in (b or {}).get("spec", {})]
    spec = api.InferenceServiceSpec.model_validate({"model": {"uri": "/m"}, **example["spec"]})
    assert spec.auth.api_key_secret == "llama-keys"
