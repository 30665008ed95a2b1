"""End to end on the local cluster (e2e/local_cluster.py), every part real: the operator
and the router run as their own ServiceAccounts, and each engine pod is a real `kaon serve`
process on the pod's IP (e2e/pod_runner.py) serving the bundled SmolLM2. The scenario: chat
through the router with the openai client; a sustained burst scales the InferenceService up
(with the Event) and, once it stops, back down after the stabilization window while the
removed engines drain and exit; a bad InferenceService is refused; deleting it removes
everything.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from openai import NotFoundError, OpenAI

from e2e.local_cluster import LOCAL_IMAGE
from support.cluster import Cluster, isvc, wait_for

SPEC = {"model": {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2"},
        "engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 2},
        "replicas": 1,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepthPerReplica": 2,
                        "scaleUpWindowSeconds": 2, "scaleDownStabilizationSeconds": 10, "maxStep": 2}}


def engines(local, namespace: str) -> list[str]:
    """This test's engine processes (the local cluster is shared: tests/e2e/conftest.py)."""
    return [key for key in local.pods.processes if key.startswith(f"{namespace}/")]


def test_chat_burst_scale_up_and_down_refusal_and_deletion(local, crd, namespace):
    cluster, router = Cluster(crd, namespace), local.router_url
    cluster.kubectl("apply", "-f", "-", input=isvc("smol", **SPEC))
    wait_for("Ready (a real engine loaded the model)", lambda: cluster.ready("smol"), timeout=180)

    client = OpenAI(base_url=f"{router}/v1", api_key="unused", timeout=300, max_retries=0)
    chat = client.chat.completions.create(model="smollm2", max_tokens=16, temperature=0,
                                          messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content

    stop = threading.Event()

    def keep_busy(i: int) -> list[str]:
        """One client sending completions back to back until told to stop."""
        finishes = []
        while not stop.is_set():
            finishes.append(client.completions.create(
                model="smollm2", prompt=f"Story number {i}: once upon a time", max_tokens=32, temperature=0,
                extra_body={"ignore_eos": True}).choices[0].finish_reason)
        return finishes
    with ThreadPoolExecutor(12) as pool:
        clients = [pool.submit(keep_busy, i) for i in range(12)]  # 2 run, 10 wait on one replica
        try:
            scaled = wait_for("the scale-up Event", lambda: [
                m for _, r, m in cluster.events("smol") if r == "Scaled" and m.startswith("Scaled up 1 → 3")],
                timeout=60)
            # 12 in flight against 0.7 x maxNumSeqs 2 = 1.4 per replica: a burst, capped at maxReplicas.
            assert "concurrency" in scaled[0] and "target 1.4" in scaled[0], scaled
            wait_for("3 ready replicas, each a real engine", lambda: cluster.status("smol")
                     .get("readyReplicas") == 3 and len(engines(local, namespace)) == 3, timeout=240)
        finally:
            stop.set()
        finishes = [f for c in clients for f in c.result()]
    assert finishes and set(finishes) == {"length"}  # every request of the load was served

    started = time.monotonic()
    wait_for("the scale-down", lambda: cluster.get("infsvc", "smol")["spec"]["replicas"] == 1, timeout=120)
    assert time.monotonic() - started >= 5  # it waited for the stabilization window
    downs = [m for _, r, m in cluster.events("smol") if r == "Scaled" and "down" in m]
    # Down to what the peak load of the window needs (the tail of the burst may still be in it),
    # so 3 -> 1 directly or through 2.
    assert any(m.startswith("Scaled down 3 → ") and "peak concurrency" in m for m in downs), downs
    wait_for("the removed engines to drain and exit", lambda: len(engines(local, namespace)) == 1, timeout=90)
    again = client.completions.create(model="smollm2", prompt="The capital of Italy is", max_tokens=4,
                                      temperature=0)
    assert "Rome" in again.choices[0].text
    described = cluster.kubectl("describe", "infsvc", "smol").stdout
    assert "Scaled up 1 → 3" in described and "Scaled down 3 → " in described

    bad = cluster.kubectl("apply", "-f", "-", check=False, input=isvc("bad", replicas=-1))
    assert bad.returncode != 0 and "should be greater than or equal to 0" in bad.stderr

    cluster.kubectl("delete", "infsvc", "smol", "--wait=true", "--timeout=60s")
    for kind in ("deployment", "service", "poddisruptionbudget", "pods"):
        wait_for(f"every {kind} gone",
                 lambda kind=kind: not cluster.get(kind, selector="kaon.dev/inferenceservice=smol"), timeout=60)
    wait_for("the last engine to exit", lambda: not engines(local, namespace), timeout=60)
    with pytest.raises(NotFoundError):
        client.completions.create(model="smollm2", prompt="Hello", max_tokens=2)
