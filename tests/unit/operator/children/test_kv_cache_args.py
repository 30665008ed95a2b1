"""What spec.engine.kvOffload and spec.routing.strategy kv-aware add to an engine pod and its NetworkPolicy."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kaon_operator import api
from kaon_operator.children import resources as r
from kaon_operator.config import NetworkPolicyConfig

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000001")


def spec(**overrides) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"}, **overrides})


def rendered(s: api.InferenceServiceSpec) -> tuple[dict, dict]:
    children = r.render(OWNER, s, NetworkPolicyConfig(release_namespace="kaon-system"))
    deployment = next(c for c in children if c["kind"] == "Deployment")
    policy = next(c for c in children if c["kind"] == "NetworkPolicy")
    return deployment["spec"]["template"]["spec"], policy


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_tiers_reach_the_engine_with_a_volume_for_the_disk():
    pod, _ = rendered(spec(engine={"kvOffload": {"hostBytes": 1 << 30, "diskBytes": 8 << 30}}))
    engine = pod["containers"][0]
    assert flag(engine["args"], "--kv-offload-bytes") == str(1 << 30)
    assert flag(engine["args"], "--kv-offload-dir") == "/var/cache/kaon-kv"
    assert flag(engine["args"], "--kv-offload-dir-bytes") == str(8 << 30)
    assert {"name": "kv-offload", "mountPath": "/var/cache/kaon-kv"} in engine["volumeMounts"]
    assert any(v["name"] == "kv-offload" and "emptyDir" in v for v in pod["volumes"])


def test_no_tiers_no_flags_no_events():
    pod, policy = rendered(spec())
    args = pod["containers"][0]["args"]
    assert not any(a.startswith("--kv-offload") or a == "--kv-events-config" for a in args)
    assert [p["port"] for p in policy["spec"]["ingress"][0]["ports"]] == [8000]


def test_kv_aware_routing_publishes_events_on_ports_the_router_may_reach():
    pod, policy = rendered(spec(routing={"strategy": "kv-aware"}))
    engine = pod["containers"][0]
    config = json.loads(flag(engine["args"], "--kv-events-config"))
    assert config == {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
                      "replay_endpoint": "tcp://*:5558", "topic": "kv-events"}
    assert {p["containerPort"] for p in engine["ports"]} == {8000, 5557, 5558}
    assert {p["port"] for p in policy["spec"]["ingress"][0]["ports"]} == {8000, 5557, 5558}


def test_negative_sizes_are_refused():
    with pytest.raises(ValidationError):
        spec(engine={"kvOffload": {"hostBytes": -1}})
