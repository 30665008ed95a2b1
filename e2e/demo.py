"""`make demo`: kaon on a local cluster, from nothing to an answer and an autoscaling round.

    python -m e2e.demo [--keep]

Starts a real control plane (built once from Go modules, cached) with a real node (kubelet,
containerd, kaon's images built here: e2e/real_cluster.py) when one can start on this machine,
else with KWOK GPU nodes, the operator and the router from this working tree, and the pod
runner; says which mode it runs in (KAON_DEMO_MODE=real|kwok forces one); applies
examples/smollm2.yaml; chats with SmolLM2 through the router with the openai client; sends
a burst that makes the autoscaler add replicas, waits for it to scale back down; prints
`kubectl get infsvc` and `kubectl describe infsvc` with the Events. `--keep` leaves it all
running until Ctrl-C and prints how to reach it.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import yaml
from openai import OpenAI

from e2e.control_plane import stop_on_sigterm
from e2e.local_cluster import LOCAL_IMAGE, LocalCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2.yaml"
# Only for the demo: engines from the working tree, and windows short enough to watch.
DEMO_OVERRIDES: dict[str, dict] = {"engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 2},
                  "autoscaling": {"enabled": True, "minReplicas": 1, "maxReplicas": 3,
                                  "targetQueueDepthPerReplica": 2, "scaleUpWindowSeconds": 2,
                                  "scaleDownStabilizationSeconds": 15, "maxStep": 2}}


def say(message: str) -> None:
    print(f"==> {message}", flush=True)


def wait(what: str, check, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"demo: timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def manifest(mode: str) -> dict:
    obj = yaml.safe_load(EXAMPLE.read_text())
    for key, value in DEMO_OVERRIDES.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    if mode == "real":  # the image built here; small requests, so three engines fit on two cores
        from e2e.real_cluster import ENGINE_IMAGE
        obj["spec"]["engine"]["image"] = ENGINE_IMAGE
        obj["spec"]["resources"] = {"requests": {"cpu": "250m", "memory": "1Gi"}}
    return obj


MODES = {"real": "a REAL node: kubelet + containerd + runc running kaon's images built here (e2e/real_cluster.py)",
         "kwok": "KWOK nodes, engines run by e2e/pod_runner.py as local processes (e2e/local_cluster.py)"}


def open_cluster(stack: ExitStack):
    """The real node when it can start on this machine, else KWOK + the pod runner.
    KAON_DEMO_MODE=real|kwok forces one (real: fail instead of falling back)."""
    wanted = os.environ.get("KAON_DEMO_MODE", "auto")
    if wanted != "kwok":
        from e2e.real_node import unavailable_reason
        reason = unavailable_reason()
        if reason is None:
            say("starting the local cluster with a real node (the first run builds kubelet, containerd's images "
                "and Kubernetes: up to ~30 min; cached after)")
            try:
                from e2e.real_cluster import RealCluster
                return stack.enter_context(RealCluster()), "real"
            except Exception as e:  # said, then the fallback
                if wanted == "real":
                    raise
                reason = f"it did not start: {e}"
        elif wanted == "real":
            raise SystemExit(f"demo: no real node on this machine: {reason}")
        say(f"no real node ({reason.splitlines()[0]}); falling back to KWOK nodes")
    say("starting the local cluster (the first run builds Kubernetes from Go modules: ~15 min)")
    return stack.enter_context(LocalCluster()), "kwok"


def run(keep: bool) -> int:
    with ExitStack() as stack:
        local, mode = open_cluster(stack)
        say(f"mode: {MODES[mode]}")
        cp = local.cp
        isvc = manifest(mode)
        name, served = isvc["metadata"]["name"], isvc["spec"]["model"]["servedName"]
        say(f"applying {EXAMPLE.relative_to(ROOT)} (demo: engine image {isvc['spec']['engine']['image']}, "
            "short autoscaling windows)")
        cp.kubectl("apply", "-n", "default", "-f", "-", input=yaml.safe_dump(isvc))

        def status() -> dict:
            return cp.kubectl_json("get", "infsvc", name, "-n", "default").get("status") or {}

        def ready() -> bool:
            return any(c["type"] == "Ready" and c["status"] == "True" for c in status().get("conditions", []))
        wait("the InferenceService to be Ready", ready, 300)

        client = OpenAI(base_url=f"{local.router_url}/v1", api_key="unused", timeout=300, max_retries=0)
        question = "What is the capital of France? Answer in one sentence."
        say(f"asking through the router: {question}")
        answer = client.chat.completions.create(model=served, max_tokens=48, temperature=0,
                                                messages=[{"role": "user", "content": question}])
        print(f"\n{(answer.choices[0].message.content or '').strip()}\n", flush=True)

        say("a burst of 12 clients: 12 requests in flight against 0.7 x maxNumSeqs 2 = 1.4 per replica, "
            "the autoscaler adds replicas")
        stop = threading.Event()

        def keep_busy(i: int) -> None:
            while not stop.is_set():
                client.completions.create(model=served, prompt=f"Tell story number {i}.", max_tokens=32)
        with ThreadPoolExecutor(12) as pool:
            for i in range(12):
                pool.submit(keep_busy, i)
            try:
                wait("3 ready replicas", lambda: status().get("readyReplicas") == 3, 300)
            finally:
                stop.set()
        say("the burst is over: scaling down after the stabilization window")
        wait("the scale-down to 1 replica", lambda: cp.kubectl_json(
            "get", "infsvc", name, "-n", "default")["spec"]["replicas"] == 1, 180)

        print(cp.kubectl("get", "infsvc", "-n", "default").stdout, flush=True)
        print(cp.kubectl("describe", "infsvc", name, "-n", "default").stdout, flush=True)
        say(f"this demo ran on {MODES[mode]}")
        if keep:
            say(f"left running. KUBECONFIG={cp.kubeconfig}  router: {local.router_url}/v1  (Ctrl-C stops it all)")
            try:
                while True:
                    time.sleep(3600)
            except KeyboardInterrupt:
                pass
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.demo", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="store_true", help="leave the cluster running until Ctrl-C or SIGTERM")
    keep = parser.parse_args().keep
    stop_on_sigterm()  # SIGTERM unwinds like Ctrl-C: every process it started is stopped, in order
    try:
        return run(keep)
    except KeyboardInterrupt:
        print("stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
