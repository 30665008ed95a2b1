"""The autoscaler loop against the real control plane: a kopf timer scrapes the engine pods'
/metrics, the policy decides, spec.replicas and the status change, an Event says why.

Engine pods are KWOK pods, so no engine runs in them; a stand-in serves each pod's /metrics
on the pod's own IP and port (KWOK gives pods loopback IPs), with the engine's real metric
names (from kaon_runtime's Metrics class) and a queue depth the test sets. The end-to-end
issue replaces these stand-ins with real `kaon serve` processes.
"""
from __future__ import annotations

import http.server
import threading

import pytest

import json

from e2e.control_plane import free_port
from kaon_operator import resources
from test_autoscaler import engine_metrics_text, router_metrics_text
from test_operator import Cluster, isvc, wait_for


def serve_text(ip: str, port: int, text) -> http.server.ThreadingHTTPServer:
    """A /metrics stand-in on (ip, port) answering text() on every GET, in a thread."""

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = text().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass
    server = http.server.ThreadingHTTPServer((ip, port), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class FakeEngines:
    """A /metrics server on the IP of every Running pod of one InferenceService."""

    def __init__(self, cluster: Cluster, name: str):
        self.cluster, self.name = cluster, name
        self.waiting = 0
        self.servers: dict[str, http.server.ThreadingHTTPServer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow_pods, daemon=True)

    def __enter__(self) -> FakeEngines:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for server in self.servers.values():
            server.shutdown()
            server.server_close()

    def _follow_pods(self) -> None:
        while not self._stop.wait(0.3):
            for pod in self.cluster.running_pods(self.name):
                ip = pod["status"].get("podIP")
                if ip and ip not in self.servers:
                    self.servers[ip] = serve_text(ip, resources.HTTP_PORT, lambda: engine_metrics_text(
                        waiting=self.waiting, running=min(self.waiting, 4), ttfts=[], finished=0))


AUTOSCALED = {"replicas": 1, "autoscaling": {
    "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetQueueDepthPerReplica": 4,
    "scaleUpWindowSeconds": 2, "scaleDownStabilizationSeconds": 5, "maxStep": 2}}


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def test_a_burst_scales_up_with_an_event_and_quiet_scales_back_down(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("auto", **AUTOSCALED))
    wait_for("Ready", lambda: cluster.ready("auto"))
    with FakeEngines(cluster, "auto") as engines:
        wait_for("observed metrics in the status", lambda: (cluster.get("infsvc", "auto")["status"]
                                                            .get("observedMetrics") or {}).get("queueDepth") == 0)
        engines.waiting = 20  # 20 per replica against a target of 4: a burst
        wait_for("4 ready replicas", lambda: cluster.get("infsvc", "auto")["status"].get("readyReplicas") == 4,
                 timeout=40)
        scaled = [m for _, r, m in cluster.events("auto") if r == "Scaled"]
        assert "Scaled up 1 → 3: queue depth 20.0 per replica > target 4 (burst)" in scaled, scaled
        assert cluster.get("deployment", "auto")["spec"]["replicas"] == 4
        decision = cluster.get("infsvc", "auto")["status"]["lastScaleDecision"]
        assert (decision["from"], decision["to"]) == (3, 4)
        # READY, DESIRED, QUEUE (20 waiting on each of 4 pods) in `kubectl get`
        wait_for("the columns", lambda: cluster.kubectl("get", "infsvc", "auto").stdout.splitlines()[1].split()[1:5]
                 == ["4", "4", "builtin://smollm2-135m-instruct", "80"])

        engines.waiting = 0
        wait_for("back to one replica", lambda: cluster.get("infsvc", "auto")["spec"]["replicas"] == 1, timeout=40)
        downs = [m for _, r, m in cluster.events("auto") if r == "Scaled" and "down" in m]
        assert "Scaled down 4 → 2: queue depth 0.0 per replica <= target 4 for 5s" in downs, downs
        # The autoscaler's Event is the only one per change: the update handler stays quiet.
        assert not [m for _, r, m in cluster.events("auto") if m.endswith("(spec.replicas)")]
    described = cluster.kubectl("describe", "infsvc", "auto").stdout
    assert "Scaled up 1 → 3" in described and "Scaled down 4 → 2" in described


def test_requests_held_by_the_router_bring_a_service_up_from_zero(cluster):
    spec = {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                           "scaleToZeroIdleSeconds": 60}}
    cluster.kubectl("apply", "-f", "-", input=isvc("zero", **spec))
    wait_for("ScaledToZero", lambda: cluster.condition("zero", "Ready").get("reason") == "ScaledToZero")
    port = free_port()
    router_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "router", "labels": {
        "app.kubernetes.io/name": "kaon", "app.kubernetes.io/component": "router"}},
        "spec": {"containers": [{"name": "router", "image": "kaon", "ports": [{"name": "http", "containerPort": port}]}]}}
    cluster.kubectl("apply", "-f", "-", input=json.dumps(router_pod))
    ip = wait_for("the router pod's IP", lambda: (cluster.get("pod", "router") or {}).get("status", {}).get("podIP"))
    held = {"count": 0}
    server = serve_text(ip, port, lambda: router_metrics_text(cluster.ns, "zero", held["count"]))
    try:
        held["count"] = 2
        wait_for("one replica", lambda: cluster.get("infsvc", "zero")["spec"]["replicas"] == 1, timeout=30)
        assert "Scaled up 0 → 1: 2 requests waiting at the router" in [m for _, r, m in cluster.events("zero")]
        wait_for("Ready", lambda: cluster.ready("zero"))
    finally:
        server.shutdown()
        server.server_close()
