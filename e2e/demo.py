"""`make demo`: kaon on a local cluster, from nothing to an answer and an autoscaling round.

    python -m e2e.demo [--keep]

Starts a real control plane with KWOK GPU nodes (built once from Go modules, cached), the
operator and the router from this working tree, and the pod runner; applies
examples/smollm2.yaml; chats with SmolLM2 through the router with the openai client; sends
a burst that makes the autoscaler add replicas, waits for it to scale back down; prints
`kubectl get infsvc` and `kubectl describe infsvc` with the Events. `--keep` leaves it all
running until Ctrl-C and prints how to reach it.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml
from openai import OpenAI

from e2e.control_plane import stop_on_sigterm
from e2e.local_cluster import LOCAL_IMAGE, LocalCluster

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "smollm2.yaml"
# Only for the demo: engines from the working tree, and windows short enough to watch.
DEMO_OVERRIDES = {"engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 2},
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


def manifest() -> dict:
    obj = yaml.safe_load(EXAMPLE.read_text())
    for key, value in DEMO_OVERRIDES.items():
        obj["spec"][key] = {**obj["spec"].get(key, {}), **value}
    return obj


def run(keep: bool) -> int:
    say("starting the local cluster (the first run builds Kubernetes from Go modules: ~15 min)")
    with LocalCluster() as local:
        cp = local.cp
        isvc = manifest()
        name, served = isvc["metadata"]["name"], isvc["spec"]["model"]["servedName"]
        say(f"applying {EXAMPLE.relative_to(ROOT)} (demo: engine image {LOCAL_IMAGE}, short autoscaling windows)")
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
        print(f"\n{answer.choices[0].message.content.strip()}\n", flush=True)

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
