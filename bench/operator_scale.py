"""Operator at scale: N InferenceServices on a KWOK cluster, against the same N Deployments
applied directly (the control plane's own floor), in the same run.

    python bench/operator_scale.py [--count 500]

Phase 1 (peer): the Deployments the operator would render are applied straight with
kubectl; time until every one is available. Phase 2 (kaon): N InferenceServices; time until
every one reports Ready, the operator's reconcile latency (apply of the children) and status
update latency from its own histograms, and its resident memory before, during and after.
Each phase has its own namespace and enough fake 8-GPU nodes for both.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "operator"))

from e2e.control_plane import ControlPlane, build_binaries  # noqa: E402
from e2e.operator_process import OperatorProcess  # noqa: E402
from kaon_operator import api  # noqa: E402
from kaon_operator.autoscaling import histogram  # noqa: E402
from kaon_operator.children import resources  # noqa: E402
from kaon_operator.crd import CRD_PATH  # noqa: E402

# KWOK marks engine pods with a kwok-ready/* image Ready with nothing behind them (e2e/kwok-stages.yaml).
SPEC = {"model": {"uri": "builtin://smollm2-135m-instruct"}, "engine": {"image": "kwok-ready/kaon:1"}}
CHUNK = 100  # objects per kubectl apply


def isvc(name: str) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": SPEC}


def apply_all(cp: ControlPlane, namespace: str, objects: list[dict]) -> None:
    for i in range(0, len(objects), CHUNK):
        cp.kubectl("apply", "-n", namespace, "-f", "-", timeout=300,
                   input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects[i:i + CHUNK]}))


def wait_all(cp: ControlPlane, namespace: str, kind: str, count: int, is_done, timeout: float) -> float:
    """Seconds until `count` objects of `kind` satisfy `is_done` (polled once a second)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        items = cp.kubectl_json("get", kind, "-n", namespace, timeout=120)["items"]
        done = sum(map(is_done, items))
        if done == count:
            return time.monotonic() - start
        print(f"  {kind}: {done}/{count} after {time.monotonic() - start:.0f}s", flush=True)
        time.sleep(1)
    raise SystemExit(f"{kind}: not all done within {timeout}s")


def deployment_available(d: dict) -> bool:
    return d.get("status", {}).get("availableReplicas", 0) >= d["spec"]["replicas"]


def isvc_ready(obj: dict) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in obj.get("status", {}).get("conditions", []))


def histogram_quantile(metrics: str, name: str, q: float) -> float:
    """The q-quantile of one of the operator's Prometheus histograms."""
    buckets = tuple((float(le), float(v)) for le, v in re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$',
                                                                  metrics, re.M))
    return histogram.quantile(buckets, q) or 0.0


def histogram_count(metrics: str, name: str) -> int:
    return int(float(re.search(rf"^{name}_count (\S+)$", metrics, re.M).group(1)))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--timeout", type=float, default=900)
    args = parser.parse_args()
    n = args.count
    nodes = math.ceil(2 * n / 8) + 2  # one GPU per engine pod, for both phases
    print(f"control plane with {nodes} fake 8-GPU nodes...", flush=True)
    with ControlPlane(build_binaries(), nodes=nodes, crds=(CRD_PATH,), startup_timeout=300) as cp:
        cp.kubectl("apply", "-f", str(ROOT / "deploy" / "operator-rbac.yaml"))
        cp.kubectl("create", "namespace", "peer")
        cp.kubectl("create", "namespace", "kaon")

        print(f"phase 1: {n} Deployments applied directly", flush=True)
        spec = api.InferenceServiceSpec.model_validate(SPEC)
        owner = lambda i: resources.Owner(name=f"svc{i}", namespace="peer", uid="")  # noqa: E731
        deployments = []
        for i in range(n):
            d = resources.deployment(owner(i), spec)
            d["metadata"].pop("ownerReferences")
            deployments.append(d)
        start = time.monotonic()
        apply_all(cp, "peer", deployments)
        peer_apply = time.monotonic() - start
        peer_total = peer_apply + wait_all(cp, "peer", "deployments", n, deployment_available, args.timeout)
        peer_load = os.getloadavg()[1]  # the machine's 5-minute load average: others' work shows here

        print(f"phase 2: {n} InferenceServices through the operator", flush=True)
        operator = OperatorProcess(cp.service_account_kubeconfig("kaon-system", "kaon-operator"),
                                   cp.workdir / "operator.log").start()
        rss = {"idle": operator.rss_bytes(), "peak": 0}
        stop = threading.Event()

        def sample_rss():
            while not stop.wait(0.5):
                rss["peak"] = max(rss["peak"], operator.rss_bytes())
        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        start = time.monotonic()
        apply_all(cp, "kaon", [isvc(f"svc{i}") for i in range(n)])
        kaon_apply = time.monotonic() - start
        kaon_total = kaon_apply + wait_all(cp, "kaon", "inferenceservices", n, isvc_ready, args.timeout)
        kaon_load = os.getloadavg()[1]
        time.sleep(5)
        stop.set()
        rss["after"] = operator.rss_bytes()
        metrics = operator.metrics()
        operator.stop()

    reconcile = [histogram_quantile(metrics, "kaon_operator_reconcile_seconds", q) for q in (0.5, 0.99)]
    status_update = [histogram_quantile(metrics, "kaon_operator_status_update_seconds", q) for q in (0.5, 0.99)]
    mib = lambda b: b / 2**20  # noqa: E731
    print(f"\n{n} objects, {nodes} fake nodes")
    print(f"peer  (Deployments applied directly): applied in {peer_apply:.1f}s, all available after {peer_total:.1f}s")
    print(f"kaon  (InferenceServices + operator): applied in {kaon_apply:.1f}s, all Ready after {kaon_total:.1f}s")
    print(f"ratio kaon / peer time to all ready: {kaon_total / peer_total:.2f}x")
    print(f"load average (5 min) at the end of each phase, {os.cpu_count()} CPUs: peer {peer_load:.1f}, "
          f"kaon {kaon_load:.1f}")
    runs = histogram_count(metrics, "kaon_operator_reconcile_seconds")
    print(f"reconcile (apply Deployment, Service, PDB, NetworkPolicy): {runs} runs ({runs / n:.2f} per object), "
          f"p50 {reconcile[0] * 1e3:.0f} ms, p99 {reconcile[1] * 1e3:.0f} ms")
    print(f"status update: {histogram_count(metrics, 'kaon_operator_status_update_seconds')} runs, "
          f"p50 {status_update[0] * 1e3:.1f} ms, p99 {status_update[1] * 1e3:.1f} ms")
    print(f"operator RSS: idle {mib(rss['idle']):.0f} MiB, peak {mib(rss['peak']):.0f} MiB, "
          f"after {mib(rss['after']):.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
