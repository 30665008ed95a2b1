"""LoRA adapters end to end on the local cluster (e2e/local_cluster.py): real `kaon serve` pods, the
operator's adapter loop and the router.

One InferenceService (its model from MinIO) with two adapters from s3:// (MinIO) and one from a
PersistentVolumeClaim. Each adapter is a random PEFT adapter that changes the greedy tokens its own
way, so a request answered by the wrong adapter (or the base) is seen: every answer must equal
transformers + peft with that adapter merged. Then, on the same pod (its uid unchanged, no
restart): an adapter added to the spec becomes servable, a removed one is a 404 in OpenAI's shape,
and an adapter whose URI holds nothing gets AdaptersReady False and a Warning Event naming it
while the base and the other adapters keep serving.
"""
from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from e2e.local_cluster import LOCAL_IMAGE, LocalCluster
from support.cluster import Cluster, wait_for
from support.sources import BUCKET, PREFIX

pytest.importorskip("peft")

from support.lora_adapters import build_adapters, greedy, merged

PROMPT = list(range(100, 116))
MAX_TOKENS = 6
# name -> peft config: distinct ranks, targets and scalings
CONFIGS = {"sql": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj"]),
           "chat": dict(r=8, lora_alpha=4, target_modules=["gate_proj", "up_proj", "down_proj"]),
           "poem": dict(r=2, lora_alpha=16, use_rslora=True, target_modules=["q_proj", "k_proj", "down_proj"]),
           "late": dict(r=4, lora_alpha=16, target_modules=["v_proj", "up_proj"])}
ADAPTER_BUCKET = "adapters"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, tiny_llama_dir):
    """The adapters' directories and each one's expected greedy tokens (None: the base's)."""
    import torch
    import transformers

    base = transformers.LlamaForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("adapters")
    dirs = build_adapters(base, root, CONFIGS)
    expected = {n: greedy(base if n is None else merged(base, dirs[n]), PROMPT, MAX_TOKENS) for n in [None, *dirs]}
    assert len({tuple(t) for t in expected.values()}) == len(expected), "each adapter must change the tokens"
    return dirs, expected


def manifest(adapters: list[dict]) -> str:
    return json.dumps({"apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": "lora"},
                       "spec": {"model": {"servedName": "lora", "uri": f"s3://{BUCKET}/{PREFIX}",
                                          "credentialsSecret": "s3-creds"},
                                "engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 4, "maxLoras": 2,
                                           "extraArgs": ["--dtype", "float32"]},
                                "adapters": adapters}})


def complete(router: str, model: str) -> httpx.Response:
    return httpx.post(f"{router}/v1/completions", timeout=120,
                      json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True})


def tokens(response: httpx.Response) -> list[int] | None:
    if response.status_code != 200:
        return None
    return [int(t.removeprefix("token_id:")) for t in response.json()["choices"][0]["logprobs"]["tokens"]]


def test_adapters_from_s3_and_a_pvc_serve_by_name_and_follow_the_spec_without_a_restart(
        local, crd, namespace, minio, adapters, tmp_path):
    dirs, expected = adapters
    cluster, router = Cluster(crd, namespace), local.router_url
    for name in ("sql", "chat", "late"):
        minio.upload_dir(ADAPTER_BUCKET, name, dirs[name])
    store = tmp_path / "adapter-store"
    shutil.copytree(dirs["poem"], store / "poem")
    # The pod runner links /mnt/adapters/<claim> on the host: one name per test and per process (another
    # cluster on this machine, a second checkout's tests, counts its namespaces from t1 too).
    claim = f"{namespace}-p{os.getpid()}-adapters"
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": claim},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(store)},
                   "claimRef": {"namespace": namespace, "name": claim}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": claim},
           "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": claim,
                    "resources": {"requests": {"storage": "1Gi"}}}}
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "s3-creds"}, "stringData": minio.env()}
    for obj in (pv, pvc, secret):
        cluster.kubectl("apply", "-f", "-", input=json.dumps(obj))
    wait_for("the claim to bind", lambda: (cluster.get("pvc", claim) or {}).get("status", {}).get("phase") == "Bound")

    sql = {"name": "sql", "uri": f"s3://{ADAPTER_BUCKET}/sql"}
    chat = {"name": "chat", "uri": f"s3://{ADAPTER_BUCKET}/chat"}
    poem = {"name": "poem", "uri": f"pvc://{claim}/poem"}
    cluster.kubectl("apply", "-f", "-", input=manifest([sql, chat, poem]))
    wait_for("Ready", lambda: cluster.ready("lora"), timeout=300)
    wait_for("AdaptersReady", lambda: cluster.condition_if("lora", "AdaptersReady", "True"), timeout=120)
    (pod,) = cluster.running_pods("lora")
    uid = pod["metadata"]["uid"]
    held = [{"name": n, "pods": [pod["metadata"]["name"]]} for n in ("chat", "poem", "sql")]
    wait_for("status.adapters", lambda: cluster.status("lora").get("adapters") == held, timeout=60)
    # The engine lists each adapter with the lora_path it was given (the URI, not the cache directory it was
    # downloaded to): what the operator compares with the spec, or it would unload and load them every round.
    assert engine_models(local, namespace) == {"lora": None, "sql": sql["uri"], "chat": chat["uri"],
                                               "poem": f"/mnt/adapters/{claim}/poem"}

    # Each adapter's own tokens, by name and by <namespace>/<name>; the base's by the served name.
    for model, adapter in (("lora", None), ("sql", "sql"), ("chat", "chat"), ("poem", "poem"),
                           (f"{namespace}/sql", "sql"), (f"{namespace}/poem", "poem"), ("sql", "sql")):
        response = complete(router, model)
        assert tokens(response) == expected[adapter], (model, response.text)

    # Added to the spec: loaded on the running pod, then servable.
    late = {"name": "late", "uri": f"s3://{ADAPTER_BUCKET}/late"}
    cluster.kubectl("apply", "-f", "-", input=manifest([sql, chat, poem, late]))
    wait_for("late served", lambda: tokens(complete(router, "late")), timeout=120)
    assert tokens(complete(router, "late")) == expected["late"]

    # Removed from the spec: a 404 in OpenAI's shape (by the router, then by the engine too).
    cluster.kubectl("apply", "-f", "-", input=manifest([sql, poem, late]))
    gone = wait_for("chat gone", lambda: (r := complete(router, "chat")).status_code == 404 and r, timeout=60)
    error = gone.json()["error"]
    assert error["code"] == "model_not_found" and "chat" in error["message"] and error["type"], gone.text
    wait_for("chat unloaded from the pod", lambda: [a["name"] for a in cluster.status("lora").get("adapters", [])]
             == ["late", "poem", "sql"] and "chat" not in engine_models(local, namespace), timeout=60)

    # An adapter whose URI holds nothing: a condition and a Warning Event name it; the rest serves on.
    broken = {"name": "broken", "uri": f"s3://{ADAPTER_BUCKET}/no-such-adapter"}
    cluster.kubectl("apply", "-f", "-", input=manifest([sql, poem, late, broken]))
    failed = wait_for("AdaptersReady False", lambda: cluster.condition_if("lora", "AdaptersReady", "False")
                      if "broken" in json.dumps(cluster.condition("lora", "AdaptersReady")) else None, timeout=90)
    assert failed["reason"] == "AdapterLoadFailed" and "base model keeps serving" in failed["message"], failed
    assert "no-such-adapter" in failed["message"], failed
    warnings = wait_for("the Warning Event", lambda: [(t, m) for t, r, m in cluster.events("lora")
                                                       if r == "AdapterLoadFailed" and "broken" in m], timeout=30)
    assert warnings[0][0] == "Warning" and f"s3://{ADAPTER_BUCKET}/no-such-adapter" in warnings[0][1], warnings
    assert cluster.ready("lora")
    for model, adapter in (("lora", None), ("sql", "sql"), ("late", "late")):
        assert tokens(complete(router, model)) == expected[adapter], model

    # The same pod all along: no rollout, no restart.
    (after,) = cluster.running_pods("lora")
    assert after["metadata"]["uid"] == uid
    assert not [c for c in after["status"].get("containerStatuses") or [] if c.get("restartCount")], after["status"]


def engine_models(local: LocalCluster, namespace: str) -> dict[str, str | None]:
    """The models the one engine pod's /v1/models lists (id -> root), asked at the pod's IP."""
    assert local.pods is not None
    (engine,) = [p for key, p in local.pods.processes.items() if key.startswith(f"{namespace}/")]
    reply = httpx.get(f"http://{engine.ip}:{engine.ports.get('http', 8000)}/v1/models", timeout=10)
    return {m["id"]: m.get("root") for m in reply.json()["data"]}
