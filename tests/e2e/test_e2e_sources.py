"""Serving your own model end to end on the local cluster (e2e/local_cluster.py): one
InferenceService per source becomes Ready and answers through the router, and bad sources end
in a condition with the reason and a Warning Event instead of an unexplained crash loop.

- hf://  the unmodified huggingface_hub client in the fetch init container, against the
         stand-in hub (e2e/fake_hub.py; the real hub cannot be reached from here), a private
         repository read with the Secret's HF_TOKEN; two replicas share a ReadWriteMany cache
         claim, and the model is downloaded once.
- s3://  a real MinIO server (built from Go modules), keys and endpoint from the Secret.
- pvc:// a PersistentVolume (hostPath) bound to a claim; the pod runner maps the mount to the
         PV's directory, so the engine reads the weights from the mounted path.
"""
from __future__ import annotations

import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from openai import OpenAI

from e2e.local_cluster import LOCAL_IMAGE
from support.cluster import Cluster, wait_for
from support.sources import BUCKET, HF_TOKEN, PREFIX, PRIVATE_REPO

NEEDED = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def isvc(name: str, model: dict, **spec) -> str:
    return json.dumps({"apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name},
                       "spec": {"model": {"servedName": name, **model},
                                "engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 2, **spec.pop("engine", {})},
                                **spec}})


def secret(name: str, data: dict[str, str]) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data})


def host_volume(cluster: Cluster, name: str, path, mode: str) -> str:
    """A hostPath PersistentVolume bound to the claim of the same name (static binding, no provisioner)."""
    pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"{cluster.ns}-{name}"},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": [mode], "storageClassName": "",
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(path)},
                   "claimRef": {"namespace": cluster.ns, "name": name}}}
    pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": name},
           "spec": {"accessModes": [mode], "storageClassName": "", "volumeName": f"{cluster.ns}-{name}",
                    "resources": {"requests": {"storage": "1Gi"}}}}
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]})


def failure(cluster: Cluster, name: str) -> dict | None:
    cond = cluster.condition(name, "Degraded")
    return cond if cond.get("status") == "True" and cond.get("reason", "").startswith("Model") else None


@pytest.fixture
def image_path(tiny_llama_dir):
    """A model "in the image": any host path outside the pod's own mounts (the pod's /tmp is an emptyDir)."""
    path = Path(tempfile.mkdtemp(prefix="kaon-image-model-", dir="/var/tmp"))
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_hf_s3_and_pvc_models_serve_and_bad_sources_say_why(local, crd, namespace, hf_hub, minio, tiny_llama_dir,
                                                            image_path, tmp_path):
    cluster, router = Cluster(crd, namespace), local.router_url
    volumes = tmp_path / "volumes"
    shutil.copytree(tiny_llama_dir, volumes / "models" / "tiny-llama")
    (volumes / "cache").mkdir()
    cluster.kubectl("apply", "-f", "-", input=host_volume(cluster, "models", volumes / "models", "ReadOnlyMany"))
    cluster.kubectl("apply", "-f", "-", input=host_volume(cluster, "model-cache", volumes / "cache", "ReadWriteMany"))
    for name, data in (("hf-token", {"HF_TOKEN": HF_TOKEN}), ("hf-wrong", {"HF_TOKEN": "hf_not_the_token"}),
                       ("s3-creds", minio.env())):
        cluster.kubectl("apply", "-f", "-", input=secret(name, data))
    wait_for("the claims to bind", lambda: all(
        (cluster.get("pvc", n) or {}).get("status", {}).get("phase") == "Bound" for n in ("models", "model-cache")))
    before = Counter({k: v for k, v in hf_hub.downloads.items() if k.startswith(PRIVATE_REPO)})

    hf_model = {"uri": f"hf://{PRIVATE_REPO}", "credentialsSecret": "hf-token", "endpoint": hf_hub.url,
                "cache": {"persistentVolumeClaim": "model-cache"}}
    manifests = [
        isvc("tiny-hf", hf_model, replicas=2),
        isvc("tiny-s3", {"uri": f"s3://{BUCKET}/{PREFIX}", "credentialsSecret": "s3-creds"}),  # endpoint: the Secret's
        isvc("tiny-pvc", {"uri": "pvc://models/tiny-llama"}),
        isvc("wrong-token", {**hf_model, "credentialsSecret": "hf-wrong", "cache": {}}),
        isvc("missing", {"uri": f"s3://{BUCKET}/no-such-model", "credentialsSecret": "s3-creds"}),
        isvc("no-fit", {"uri": "pvc://models/tiny-llama"}, engine={"tensorParallelSize": 3}),
        # No init container for a path in the image: the engine's own start error says it.
        isvc("no-fit-path", {"uri": str(image_path)}, engine={"tensorParallelSize": 3}),
    ]
    for manifest in manifests:
        cluster.kubectl("apply", "-f", "-", input=manifest)

    expected = {"wrong-token": ("ModelFetchFailed", "unauthorized: hf://kaon-test/private-llama@main: the hub "
                                                    "refused the credentials (401)"),
                "missing": ("ModelFetchFailed", "not found: s3://models/no-such-model: no objects under this prefix"),
                "no-fit": ("ModelDoesNotFit", "model does not fit: tensorParallelSize 3 does not divide its 4 "
                                              "attention heads"),
                "no-fit-path": ("ModelDoesNotFit", "model does not fit: tensor_parallel_size 3 does not divide its "
                                                   "4 attention heads")}
    for name, (reason, words) in expected.items():
        cond = wait_for(f"{name}: Degraded with {reason}", lambda name=name: failure(cluster, name), timeout=240)
        assert cond["reason"] == reason and words in cond["message"], cond
        events = [(t, r, m) for t, r, m in cluster.event_posted(name, reason) if r == reason]  # trails the condition
        assert events and events[0][0] == "Warning" and words in events[0][2], cluster.events(name)
        assert not cluster.ready(name)
    for name in expected:  # retried with a back-off meanwhile, but never taken for recovered in between
        assert not [r for _, r, _ in cluster.events(name) if r == "Recovered"], cluster.events(name)
        assert cluster.condition(name, "Degraded")["reason"] == expected[name][0]

    client = OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=120, max_retries=0)
    for name in ("tiny-hf", "tiny-s3", "tiny-pvc"):
        wait_for(f"{name} Ready (a real engine loaded the fetched weights)", lambda name=name: cluster.ready(name),
                 timeout=300)
        answer = client.completions.create(model=name, prompt="Once upon a time", max_tokens=4, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert answer.usage.completion_tokens == 4 and answer.choices[0].finish_reason == "length"
        assert cluster.condition(name, "Degraded")["status"] == "False"
    wait_for("both tiny-hf replicas ready", lambda: cluster.status("tiny-hf")
             .get("readyReplicas") == 2, timeout=300)

    # The two hf replicas shared the claim: every needed file came from the hub once, nothing else did.
    fetched = Counter({k: v for k, v in hf_hub.downloads.items() if k.startswith(PRIVATE_REPO)}) - before
    assert fetched == Counter(f"{PRIVATE_REPO}/{n}" for n in NEEDED), fetched
    assert (volumes / "cache" / "models" / "hf" / PRIVATE_REPO / "main" / ".kaon-complete.json").is_file()
    # The pvc engine runs on the PersistentVolume's directory, which the pod mounts at /mnt/models.
    pvc_pod = cluster.pods("tiny-pvc")[0]
    assert "/mnt/models/tiny-llama" in pvc_pod["spec"]["containers"][0]["args"]
    engine = local.pods.processes[f"{namespace}/{pvc_pod['metadata']['name']}"]
    assert str(volumes / "models" / "tiny-llama") in engine.proc.args
    # The fetch's state is in the pod's status, as a kubelet reports it.
    (fetch_status,) = pvc_pod["status"]["initContainerStatuses"]
    assert fetch_status["name"] == "fetch" and fetch_status["state"]["terminated"]["exitCode"] == 0

    described = cluster.kubectl("describe", "infsvc", "wrong-token").stdout
    assert "ModelFetchFailed" in described and "unauthorized" in described
    # Fixing the Secret is enough: the retried fetch succeeds and the service becomes Ready.
    cluster.kubectl("apply", "-f", "-", input=secret("hf-wrong", {"HF_TOKEN": HF_TOKEN}))
    wait_for("wrong-token Ready once its Secret is fixed", lambda: cluster.ready("wrong-token"), timeout=300)
    cluster.event_posted("wrong-token", "Recovered")  # kopf posts it from its queue, after the status


def test_an_engine_that_cannot_start_is_a_crash_loop_with_its_error_then_recovers(local, crd, namespace):
    """The engine process really exits (a model that does not exist); the pod runner restarts it with a
    back-off and reports lastState with the log's tail; the operator puts its last line in Degraded."""
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc("nomodel", {"uri": "builtin://does-not-exist"}))
    cond = wait_for("Degraded", lambda: cluster.condition_if("nomodel", "Degraded", "True"), timeout=120)
    assert cond["reason"] == "CrashLoopBackOff", cond
    assert "container engine exited with code 2" in cond["message"], cond
    assert ": kaon: error: unknown builtin model 'does-not-exist'; available: " in cond["message"], cond
    assert not cluster.ready("nomodel")
    engine = cluster.pods("nomodel")[0]["status"]["containerStatuses"][0]
    assert engine["restartCount"] >= 1 and engine["lastState"]["terminated"]["exitCode"] == 2, engine

    cluster.kubectl("patch", "infsvc", "nomodel", "--type=merge", "-p",
                    json.dumps({"spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}}}))
    wait_for("Ready and not Degraded", lambda: cluster.ready("nomodel") and
             cluster.condition("nomodel", "Degraded").get("status") == "False", timeout=240)
    events = cluster.event_posted("nomodel", "Recovered")  # kopf posts it from its queue, after the status
    assert [r for t, r, _m in events if t == "Warning"] == ["CrashLoopBackOff"], events  # once, not per restart
    assert ("Normal", "Recovered", "no longer degraded (CrashLoopBackOff)") in events


def test_the_pod_runner_maps_paths_under_a_mount_to_its_host_directory(tmp_path):
    from e2e.pod_runner import translate

    mounts = [("/var/cache/kaon", tmp_path / "cache"), ("/mnt/models", tmp_path / "pv"), ("/tmp", tmp_path / "tmp")]
    assert translate("/mnt/models/llama/3.1", mounts) == str(tmp_path / "pv" / "llama" / "3.1")
    assert translate("/mnt/models", mounts) == str(tmp_path / "pv")
    assert translate("/var/cache/kaon/models", mounts) == str(tmp_path / "cache" / "models")
    assert translate("/mnt/modelsx", mounts) == "/mnt/modelsx"  # a prefix of a name is not a parent directory
    assert translate("hf://org/name", mounts) == "hf://org/name" and translate("8000", mounts) == "8000"
