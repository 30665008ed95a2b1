"""How long a pod's Ready condition, written as a kubelet writes it (PATCH pods/status), takes to reach a pod
watch: the last part of a standby's wake before the routers send to it (they watch the engine pods themselves,
router/watch.py, not Endpoints). On the local control plane (e2e/control_plane.py: etcd and kube-apiserver; no
kubelet: the pod is bound to a node no one runs, so nothing else writes its status).

    python bench/pod_ready_watch.py [--rounds 100]

Prints the median, p90 and max from the PATCH's start to the watch's event, and the PATCH's own round trip. What it
leaves out: the kubelet's own path from a probe's result to that PATCH (its status manager writes a readiness change
at once, no batching). bench/autoscale_sim.py's READY_TO_ROUTER_S allows 0.1 s for the whole.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kubernetes  # noqa: E402

from e2e.control_plane import ControlPlane, build_binaries  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=100)
    args = parser.parse_args()
    cp = ControlPlane(build_binaries(), nodes=0).start()
    try:
        cp.kubectl("apply", "-f", "-", input=json.dumps({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "ready-watch", "namespace": "default", "labels": {"bench": "ready-watch"}},
            "spec": {"nodeName": "nowhere", "containers": [{"name": "c", "image": "none"}]}}))
        api = kubernetes.client.CoreV1Api(kubernetes.config.new_client_from_config(str(cp.kubeconfig)))
        seen: dict[str, float] = {}
        arrived = threading.Condition()

        def watch() -> None:
            stream = kubernetes.watch.Watch().stream(api.list_namespaced_pod, "default",
                                                     label_selector="bench=ready-watch", timeout_seconds=3600)
            try:
                for event in stream:
                    now = time.perf_counter()
                    tag = next((c.message for c in event["object"].status.conditions or [] if c.type == "Ready"), None)
                    if tag:
                        with arrived:
                            seen.setdefault(tag, now)
                            arrived.notify_all()
            except Exception:  # noqa: BLE001 - the apiserver stopping ends the watch
                return

        threading.Thread(target=watch, daemon=True).start()
        time.sleep(2)  # the watch established
        latency, writes = [], []
        for i in range(args.rounds):
            tag = f"round-{i}"  # each write carries its own message, so each event is matched to its write
            body = {"status": {"conditions": [{"type": "Ready", "status": "True" if i % 2 else "False",
                                               "message": tag, "lastTransitionTime": "2026-01-01T00:00:00Z"}]}}
            started = time.perf_counter()
            api.patch_namespaced_pod_status("ready-watch", "default", body)
            writes.append(time.perf_counter() - started)
            with arrived:
                if not arrived.wait_for(lambda tag=tag: tag in seen, timeout=30):
                    raise SystemExit(f"the watch did not see write {i} within 30 s")
            latency.append(seen[tag] - started)
            time.sleep(0.2)
    finally:
        cp.stop()
    latency.sort()
    print(f"PATCH pods/status -> the pod watch's event, {args.rounds} rounds: median "
          f"{1e3 * statistics.median(latency):.1f} ms, p90 {1e3 * latency[int(0.9 * len(latency))]:.1f} ms, max "
          f"{1e3 * latency[-1]:.1f} ms; the PATCH's own round trip median {1e3 * statistics.median(writes):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
