"""End to end on the local cluster's real node (e2e/real_cluster.py): kubelet + containerd + runc,
kaon's own images built by e2e/build-images.sh, the Helm chart installed as it is (image names
only), the operator and the router as real pods, engines as real containers.

What a kubelet does is real here, unlike tests/e2e/test_e2e.py's pod runner: probes, SIGTERM and
the grace period, SIGKILL, restarts, volumes, image contents, the chart's securityContext.
The engine runs on the CPU; the node advertises fake `nvidia.com/gpu`s so engine pods schedule.

Opt-in: `make e2e-node` (which installs and builds what the node needs) sets KAON_REAL_NODE=1;
without it these tests skip, so `make test` neither builds the images (about 12 minutes on 2
cores, ~25 GB of disk) nor changes the host's network. With it, they still skip, with the reason,
where the node cannot start: not root, or containerd, runc, the CNI plugins, nft or socat missing.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time

import httpx
import pytest
from openai import OpenAI

from e2e.real_node import unavailable_reason

REASON = (unavailable_reason() if os.environ.get("KAON_REAL_NODE") == "1"
          else "opt-in: `make e2e-node` (or KAON_REAL_NODE=1) runs these")
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"no real node: {REASON}")

NS = "default"


@pytest.fixture(scope="module")
def real():
    from e2e.real_cluster import RealCluster
    with RealCluster() as cluster:
        yield cluster


def isvc(name: str, uri: str = "builtin://smollm2-135m-instruct", replicas: int = 1, drain: int = 30,
         **engine) -> str:
    from e2e.real_cluster import ENGINE_IMAGE
    return json.dumps({
        "apiVersion": "kaon.dev/v1alpha1", "kind": "InferenceService", "metadata": {"name": name, "namespace": NS},
        "spec": {"model": {"uri": uri, "servedName": name}, "replicas": replicas, "drainSeconds": drain,
                 "engine": {"image": ENGINE_IMAGE, "maxNumSeqs": 4, **engine},
                 # Two shared cores: small requests, so three engines, the operator and the routers fit.
                 "resources": {"requests": {"cpu": "250m", "memory": "1Gi"}}}})


def status(real, name: str) -> dict:
    return real.cp.kubectl_json("get", "infsvc", name, "-n", NS).get("status") or {}


def is_ready(real, name: str) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in status(real, name).get("conditions", []))


def ready_pods(real, name: str) -> list[dict]:
    return [p for p in real.engine_pods(name) if not p["metadata"].get("deletionTimestamp")
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p["status"].get("conditions", []))]


def events(real, name: str) -> list[dict]:
    return real.cp.kubectl_json("get", "events", "-n", NS, "--field-selector",
                                f"involvedObject.name={name}")["items"]


def test_chart_pods_are_real_and_a_chat_goes_through_the_router_service(real):
    # The chart's operator and router: containers of the operator image, Ready by their probes.
    system = real.cp.kubectl_json("get", "pods", "-n", "kaon-system")["items"]
    assert {p["metadata"]["labels"]["app.kubernetes.io/component"] for p in system} == {"operator", "router"}
    for pod in system:
        assert pod["spec"]["nodeName"] == "kaon-node"
        (container,) = pod["status"]["containerStatuses"]
        assert container["ready"] and container["image"].startswith("kaon.local/kaon-operator:dev")
        assert container["containerID"].startswith("containerd://")

    real.cp.kubectl("apply", "-f", "-", input=isvc("chat"))
    real.wait("InferenceService chat Ready", lambda: is_ready(real, "chat"), 600, 2)
    (pod,) = real.engine_pods("chat")
    (container,) = pod["status"]["containerStatuses"]
    assert container["image"].startswith("kaon.local/kaon:dev") and container["started"] and container["ready"]
    assert pod["status"]["podIP"].startswith("10.244.0.")

    client = OpenAI(base_url=f"{real.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
    # (not the capital of France: a 0.08-nat tie for the bundled model, which its default int4 arithmetic tips)
    answer = client.chat.completions.create(model="chat", max_tokens=32, temperature=0, messages=[
        {"role": "user", "content": "Who wrote 'Pride and Prejudice'?"}])
    assert "Austen" in answer.choices[0].message.content
    real.cp.kubectl("delete", "infsvc", "chat", "-n", NS, "--wait=true", "--timeout=120s")


def _stream(url: str, model: str, out: dict) -> None:
    """One streamed completion straight to an engine pod; records the chunks and how it ended."""
    body = {"model": model, "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper."}],
            "max_tokens": 200, "temperature": 0, "stream": True}
    out["chunks"], out["start"] = 0, time.monotonic()
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    out["chunks"] += 1
                    out["finish"] = chunk["choices"][0].get("finish_reason") or out.get("finish")
                elif line == "data: [DONE]":
                    out["done"] = True
                    out["end"] = time.monotonic()
    except httpx.HTTPError as e:
        out["error"], out["end"] = repr(e), time.monotonic()


def test_scale_up_then_down_drains_in_flight_requests_through_sigterm(real):
    # drainSeconds 60: the engine finishes what is in flight for up to 60 s after SIGTERM (the pod's
    # grace period is 75 s); a 200-token stream on this CPU takes well under that.
    real.cp.kubectl("apply", "-f", "-", input=isvc("scale", replicas=1, drain=60))
    real.wait("scale Ready", lambda: is_ready(real, "scale"), 600, 2)
    real.cp.kubectl("patch", "infsvc", "scale", "-n", NS, "--type=merge", "-p", '{"spec": {"replicas": 2}}')
    real.wait("2 ready engine pods", lambda: len(ready_pods(real, "scale")) == 2, 600, 2)

    # A long stream on each pod, straight to its IP, so the pod that goes has a request in flight.
    pods = ready_pods(real, "scale")
    results = {p["metadata"]["name"]: {} for p in pods}
    threads = [threading.Thread(target=_stream, args=(f"http://{p['status']['podIP']}:8000", "scale",
                                                      results[p["metadata"]["name"]])) for p in pods]
    for t in threads:
        t.start()
    real.wait("both streams under way", lambda: all(r.get("chunks", 0) >= 5 for r in results.values()), 120, 0.2)
    real.cp.kubectl("patch", "infsvc", "scale", "-n", NS, "--type=merge", "-p", '{"spec": {"replicas": 1}}')
    real.wait("one pod terminating", lambda: any(p["metadata"].get("deletionTimestamp")
                                                 for p in real.engine_pods("scale")), 60, 0.2)
    terminating_since = time.monotonic()
    gone = next(p["metadata"]["name"] for p in real.engine_pods("scale") if p["metadata"].get("deletionTimestamp"))
    for t in threads:
        t.join(timeout=180)
    # The kubelet's SIGTERM made the engine drain: the request in flight on the pod that went
    # ran to its end (max_tokens) within the grace period, like the one on the pod that stays.
    for result in results.values():
        result["sigterm_after_s"] = round(terminating_since - result["start"], 1)
        result["ended_after_s"] = round(result.get("end", 0) - result["start"], 1)
    for name, result in results.items():
        assert result.get("error") is None and result.get("status") == 200, (name, result)
        assert result.get("done") and result.get("finish") in ("length", "stop"), (name, result)
    assert results[gone]["end"] > terminating_since, "the stream on the pod that went ended before its SIGTERM"
    assert any(e["reason"] == "Killing" for e in events(real, gone))
    real.wait("the pod that went is gone", lambda: gone not in {p["metadata"]["name"]
                                                             for p in real.engine_pods("scale")}, 120)
    assert len(ready_pods(real, "scale")) == 1
    real.cp.kubectl("delete", "infsvc", "scale", "-n", NS, "--wait=true", "--timeout=120s")


def test_liveness_probe_restarts_a_wedged_engine(real):
    # stallTimeoutSeconds 24: the liveness probe runs every 2 s, three misses restart the engine.
    real.cp.kubectl("apply", "-f", "-", input=isvc("wedge", stallTimeoutSeconds=24))
    real.wait("wedge Ready", lambda: is_ready(real, "wedge"), 600, 2)
    (pod,) = real.engine_pods("wedge")
    container_id = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    # SIGSTOP to the container's process (kaon serve is PID 1 in it): it stops answering /health.
    real.node.ctr("tasks", "kill", "--signal", "SIGSTOP", container_id)

    def restarted() -> bool:
        (p,) = real.engine_pods("wedge")
        (c,) = p["status"]["containerStatuses"]
        return c["restartCount"] >= 1 and c["ready"]
    real.wait("the engine restarted and Ready again", restarted, 300, 2)
    (pod,) = real.engine_pods("wedge")
    (c,) = pod["status"]["containerStatuses"]
    assert c["lastState"]["terminated"]["exitCode"] in (137, 143)
    reasons = [e["reason"] for e in events(real, pod["metadata"]["name"])]
    assert "Unhealthy" in reasons and "Killing" in reasons
    real.cp.kubectl("delete", "infsvc", "wedge", "-n", NS, "--wait=true", "--timeout=120s")


def test_pvc_model_is_served_from_a_mounted_volume(real, tiny_llama_dir):
    # A hostPath PersistentVolume the kubelet mounts into the engine container (uid 1000 reads it).
    root = tempfile.mkdtemp(prefix="kaon-pv-")
    try:
        os.chmod(root, 0o755)
        shutil.copytree(tiny_llama_dir, f"{root}/tiny-llama")
        for dirpath, dirnames, filenames in os.walk(root):
            for d in dirnames:
                os.chmod(os.path.join(dirpath, d), 0o755)
            for f in filenames:
                os.chmod(os.path.join(dirpath, f), 0o644)
        pv = {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": "real-models"},
              "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadOnlyMany"], "storageClassName": "",
                       "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": root, "type": "Directory"},
                       "claimRef": {"namespace": NS, "name": "models"}}}
        pvc = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": "models", "namespace": NS},
               "spec": {"accessModes": ["ReadOnlyMany"], "storageClassName": "", "volumeName": "real-models",
                        "resources": {"requests": {"storage": "1Gi"}}}}
        real.cp.kubectl("apply", "-f", "-", input=json.dumps({"apiVersion": "v1", "kind": "List", "items": [pv, pvc]}))
        real.cp.kubectl("apply", "-f", "-", input=isvc("tiny-pvc", uri="pvc://models/tiny-llama"))
        real.wait("tiny-pvc Ready", lambda: is_ready(real, "tiny-pvc"), 600, 2)
        (pod,) = real.engine_pods("tiny-pvc")
        mounts = {v["name"]: v for v in pod["spec"]["volumes"]}
        assert any((v.get("persistentVolumeClaim") or {}).get("claimName") == "models" for v in mounts.values())
        client = OpenAI(base_url=f"{real.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
        out = client.completions.create(model="tiny-pvc", prompt="Hello", max_tokens=8, temperature=0)
        assert out.usage.completion_tokens >= 1
        real.cp.kubectl("delete", "infsvc", "tiny-pvc", "-n", NS, "--wait=true", "--timeout=120s")
    finally:
        real.cp.kubectl("delete", "pvc", "models", "-n", NS, "--wait=false", check=False)
        real.cp.kubectl("delete", "pv", "real-models", "--wait=false", check=False)
        shutil.rmtree(root, ignore_errors=True)
