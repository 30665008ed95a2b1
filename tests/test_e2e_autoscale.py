"""End to end on the local control plane, every part real: the operator and the router run
as their own ServiceAccounts, and each engine pod is a real `kaon serve` process on the
pod's IP (e2e/pod_runner.py) serving the bundled SmolLM2. A burst of requests through the
router makes the InferenceService scale up, with the Event; when the load stops it scales
back down after the stabilization window, and the removed engines drain and exit.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from openai import OpenAI

from e2e.control_plane import _die_with_parent, free_port
from e2e.pod_runner import PodRunner
from test_operator import Cluster, isvc, wait_for

ROUTER_RBAC = Path(__file__).resolve().parents[1] / "deploy" / "router-rbac.yaml"
SPEC = {"model": {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2"},
        "engine": {"image": "local/kaon:dev", "maxNumSeqs": 2},
        "replicas": 1,
        "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3, "targetQueueDepthPerReplica": 2,
                        "scaleUpWindowSeconds": 2, "scaleDownStabilizationSeconds": 10, "maxStep": 2}}


@pytest.fixture
def router(crd):
    """`kaon router` as the kaon-router ServiceAccount, on a loopback port."""
    crd.kubectl("apply", "-f", str(ROUTER_RBAC))
    kubeconfig = crd.service_account_kubeconfig("kaon-system", "kaon-router")
    port = free_port()
    with open(crd.workdir / "router.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "kaon_runtime.cli", "router", "--port", str(port),
                                 "--kubeconfig", str(kubeconfig), "--queue-timeout", "120"],
                                stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"

    def ready():
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=1) as resp:
                return resp.status == 200
        except OSError:
            return False
    wait_for("the router", ready)
    yield url
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def test_chat_through_the_router_then_a_burst_scales_up_and_quiet_scales_down(cluster, router, crd):
    with PodRunner(crd, crd.workdir) as runner:
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
                assert "queue depth" in scaled[0] and "> target 2" in scaled[0], scaled
                wait_for("3 ready replicas, each a real engine", lambda: cluster.get("infsvc", "smol")["status"]
                         .get("readyReplicas") == 3 and len(runner.processes) == 3, timeout=240)
            finally:
                stop.set()
            finishes = [f for c in clients for f in c.result()]
        assert finishes and set(finishes) == {"length"}  # every request of the load was served

        started = time.monotonic()
        wait_for("the scale-down", lambda: cluster.get("infsvc", "smol")["spec"]["replicas"] == 1, timeout=120)
        assert time.monotonic() - started >= 5  # it waited for the stabilization window
        downs = [m for _, r, m in cluster.events("smol") if r == "Scaled" and "down" in m]
        # Down in proportion to the highest load of the window (the tail of the burst may leave a
        # little queue), so 3 -> 1 directly or through 2.
        assert any(m.startswith("Scaled down 3 → ") and "per replica <= target 2 for 10s" in m for m in downs), downs
        wait_for("the removed engines to drain and exit", lambda: len(runner.processes) == 1, timeout=90)
        again = client.completions.create(model="smollm2", prompt="The capital of Italy is", max_tokens=4,
                                          temperature=0)
        assert "Rome" in again.choices[0].text
    described = cluster.kubectl("describe", "infsvc", "smol").stdout
    assert "Scaled up 1 → 3" in described and "Scaled down 3 → " in described
    if os.environ.get("KAON_E2E_SHOW"):
        print(described)
