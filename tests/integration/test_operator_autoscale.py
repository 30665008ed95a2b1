"""The autoscaler loop against the real control plane: a kopf timer scrapes the engine pods'
/metrics, the policy decides, spec.replicas and the status change, an Event says why.

Engine pods are KWOK pods, so no engine runs in them; a stand-in serves each pod's /metrics
on the pod's own IP and port (KWOK gives pods loopback IPs), with the engine's real metric
names (from kaon_runtime's Metrics class) and a queue depth the test sets. The end-to-end
issue replaces these stand-ins with real `kaon serve` processes.
"""
from __future__ import annotations

import http.server
import json
import threading
import time

import pytest

from e2e.control_plane import free_port
from kaon_operator.children import resources
from support.cluster import Cluster, isvc, wait_for
from support.metrics_text import engine_metrics_text, router_metrics_text


def serve_text(ip: str, port: int, text) -> http.server.ThreadingHTTPServer:
    """A /metrics stand-in on (ip, port) answering text() on every GET (503 when it is None), in a thread."""

    class Metrics(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            answer = text()
            if answer is None:  # failing: the scraper reads nothing from it
                self.send_error(503)
                return
            body = answer.encode()
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
    """A /metrics server on the IP of every Running pod of one InferenceService, showing
    `in_flight` requests per pod (up to 64 running, the rest waiting), or failing while
    `answering` is False (a NetworkPolicy, a wedged engine)."""

    def __init__(self, cluster: Cluster, name: str):
        self.cluster, self.name = cluster, name
        self.in_flight = 0
        self.answering = True
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

    def _text(self) -> str | None:
        if not self.answering:
            return None
        return engine_metrics_text(waiting=max(0, self.in_flight - 64), running=min(self.in_flight, 64),
                                   ttfts=[], finished=0)

    def _follow_pods(self) -> None:
        while not self._stop.wait(0.3):
            for pod in self.cluster.running_pods(self.name):
                ip = pod["status"].get("podIP")
                if ip and ip not in self.servers:
                    self.servers[ip] = serve_text(ip, resources.HTTP_PORT, self._text)


AUTOSCALED = {"replicas": 1, "autoscaling": {
    "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetConcurrencyPerReplica": 4,
    "scaleUpWindowSeconds": 2, "scaleDownStabilizationSeconds": 5, "maxStep": 2}}


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def scaled(cluster: Cluster, name: str) -> list[str]:
    return [m for _, r, m in cluster.events(name) if r == "Scaled"]


def test_a_burst_scales_up_with_an_event_and_quiet_scales_back_down(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("auto", **AUTOSCALED))
    wait_for("Ready", lambda: cluster.ready("auto"))
    with FakeEngines(cluster, "auto") as engines:
        # KWOK pods are Ready before the stand-in serves their /metrics: unavailable, then available.
        wait_for("MetricsAvailable", lambda: cluster.condition_if("auto", "MetricsAvailable", "True"), timeout=20)
        engines.in_flight = 20  # 20 per replica against a target of 4: a burst
        wait_for("4 ready replicas", lambda: cluster.status("auto").get("readyReplicas") == 4,
                 timeout=40)
        # The loop posts its Events after writing spec.replicas, and KWOK's pods are Ready at once: wait for them.
        cluster.event_posted("auto", "Scaled", contains="Scaled up 3 → 4")
        assert "Scaled up 1 → 3: concurrency 20 > 2x target 4 x 1 (burst)" in scaled(cluster, "auto")
        assert cluster.get("deployment", "auto")["spec"]["replicas"] == 4
        decision = cluster.status("auto")["lastScaleDecision"]
        assert (decision["from"], decision["to"]) == (3, 4)
        # 20 in flight on the first replica already ask for 5: capped at 4, and said once for the episode
        # (then 60 on 3 ask for 15, 80 on 4 for 20).
        capped = [m for _, r, m in cluster.event_posted("auto", "ScaleCapped") if r == "ScaleCapped"]
        assert capped == ["the load asks for 5 replicas; capped at maxReplicas 4: "
                          "concurrency 20 > 2x target 4 x 1 (burst)"], capped
        observed = cluster.status("auto")["observedMetrics"]
        assert observed["targetConcurrencyPerReplica"] == 4
        # READY, DESIRED, QUEUE in `kubectl get`
        wait_for("the columns", lambda: cluster.kubectl("get", "infsvc", "auto").stdout.splitlines()[1].split()[1:3]
                 == ["4", "4"])

        engines.in_flight = 1
        wait_for("back to one replica", lambda: cluster.get("infsvc", "auto")["spec"]["replicas"] == 1, timeout=60)
        downs = [m for m in scaled(cluster, "auto") if "down" in m]
        assert "Scaled down 4 → 2: peak concurrency 4 in 5s fits 2 at 4 per replica" in downs, downs
        # The autoscaler's Event is the only one per change: the update handler stays quiet.
        assert not [m for _, r, m in cluster.events("auto") if m.endswith("(spec.replicas)")]
    described = cluster.kubectl("describe", "infsvc", "auto").stdout
    assert "Scaled up 1 → 3" in described and "Scaled down 4 → 2" in described


def test_unreachable_engine_metrics_hold_replicas_with_a_condition_and_an_event(cluster):
    spec = {**AUTOSCALED, "replicas": 2, "autoscaling": {**AUTOSCALED["autoscaling"], "minReplicas": 1}}
    cluster.kubectl("apply", "-f", "-", input=isvc("blind", **spec))
    with FakeEngines(cluster, "blind") as engines:
        engines.in_flight = 3  # 6 in flight need 2 replicas at 4 each (with 10% to spare): it stays at 2
        wait_for("MetricsAvailable", lambda: cluster.condition_if("blind", "MetricsAvailable", "True"), timeout=40)
        # KWOK pods are Ready before the stand-in answers, so an episode may already have been posted.
        before = [m for _, r, m in cluster.events("blind") if r == "MetricsUnavailable"]
        engines.answering = False  # the scrapes fail: read as zero load, it would go down to 1
        condition = wait_for("MetricsAvailable=False", lambda: cluster.condition_if(
            "blind", "MetricsAvailable", "False"), timeout=30)
        assert condition["reason"] == "ScrapeFailed"
        assert condition["message"] == \
            "2 of 2 ready replicas did not answer the scrape; no scale-down until they answer"
        time.sleep(8)  # longer than the 5 s stabilization window
        assert cluster.get("infsvc", "blind")["spec"]["replicas"] == 2
        warnings = [m for _, r, m in cluster.events("blind") if r == "MetricsUnavailable"]
        assert sorted(warnings) == sorted(before + [condition["message"]]), warnings  # one for this episode
        engines.answering = True
        wait_for("MetricsAvailable again", lambda: cluster.condition_if("blind", "MetricsAvailable", "True"),
                 timeout=30)


def test_requests_held_by_the_router_bring_a_service_up_from_zero(cluster):
    spec = {"replicas": 0, "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 2,
                                           "scaleToZeroIdleSeconds": 60}}
    cluster.kubectl("apply", "-f", "-", input=isvc("zero", **spec))
    wait_for("ScaledToZero", lambda: cluster.condition("zero", "Ready").get("reason") == "ScaledToZero")
    port = free_port()
    # The router runs in the operator's release namespace (kaon-system), not beside the service.
    name = f"router-{cluster.ns}"
    router_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": "kaon-system", "labels": {
        "app.kubernetes.io/name": "kaon", "app.kubernetes.io/component": "router"}},
        "spec": {"containers": [{"name": "router", "image": "kaon",
                                 "ports": [{"name": "http", "containerPort": port}]}]}}
    cluster.cp.kubectl("apply", "-f", "-", input=json.dumps(router_pod))
    ip = wait_for("the router pod's IP", lambda: json.loads(cluster.cp.kubectl(
        "get", "pod", name, "-n", "kaon-system", "-o", "json").stdout).get("status", {}).get("podIP"))
    held = {"count": 0}
    server = serve_text(ip, port, lambda: router_metrics_text(cluster.ns, "zero", held["count"]))
    try:
        held["count"] = 2
        wait_for("one replica", lambda: cluster.get("infsvc", "zero")["spec"]["replicas"] == 1, timeout=30)
        # Posted after spec.replicas is written: wait for the Event itself.
        cluster.event_posted("zero", "Scaled", contains="Scaled up 0 → 1: 2 requests waiting at the router")
        wait_for("Ready", lambda: cluster.ready("zero"))
    finally:
        server.shutdown()
        server.server_close()
        cluster.cp.kubectl("delete", "pod", name, "-n", "kaon-system", "--wait=false", check=False)


def test_deleting_an_autoscaled_service_is_not_blocked_while_the_operator_is_down(cluster, operator):
    cluster.kubectl("apply", "-f", "-", input=isvc("orphan", **AUTOSCALED))
    wait_for("Ready", lambda: cluster.ready("orphan"))
    wait_for("an autoscale tick", lambda: cluster.status("orphan").get("observedMetrics"))
    assert not cluster.get("infsvc", "orphan")["metadata"].get("finalizers")
    operator.stop()
    try:
        cluster.kubectl("delete", "infsvc", "orphan", "--wait=true", "--timeout=20s")
        assert cluster.get("infsvc", "orphan") is None
    finally:
        operator.start()


def test_only_one_operator_replica_holds_the_autoscaler_lease(operator_kubeconfig):
    """As the operator's own ServiceAccount (so the Role's verbs are checked too)."""
    import kubernetes

    from kaon_operator.kube import Kube

    kube = Kube(kubernetes.config.new_client_from_config(config_file=str(operator_kubeconfig)))
    name = f"lease-{time.monotonic_ns()}"
    assert kube.hold_lease("kaon-system", name, "a", 2)  # created
    assert kube.hold_lease("kaon-system", name, "a", 2)  # renewed
    assert not kube.hold_lease("kaon-system", name, "b", 2)  # a's is current
    time.sleep(2.5)
    assert kube.hold_lease("kaon-system", name, "b", 2)  # a stopped renewing: b takes over
    assert not kube.hold_lease("kaon-system", name, "a", 2)


def test_a_scale_decision_never_overwrites_a_change_made_since(cluster, operator_kubeconfig):
    """The autoscaler's writes carry the resourceVersion its decision was made on: a write by someone
    else that left the spec alone (a status update) is retried at the new version; a changed spec (a
    human's `kubectl scale`) wins, the decision is dropped and the status does not claim it."""
    import kubernetes

    from kaon_operator.autoscaling.autoscale_loop import AutoscaleLoop
    from kaon_operator.caches import Caches
    from kaon_operator.config import AutoscaleSettings, OperatorConfig
    from kaon_operator.context import Context
    from kaon_operator.kube import Conflict, Kube

    kube = Kube(kubernetes.config.new_client_from_config(config_file=str(operator_kubeconfig)))
    loop = AutoscaleLoop(Context(OperatorConfig(autoscale=AutoscaleSettings(interval=1)), kube, Caches()))
    record = loop.ctx.records.get((cluster.ns, "occ"))
    cluster.kubectl("apply", "-f", "-", input=isvc("occ"))
    wait_for("Ready", lambda: cluster.ready("occ"))

    def decision(to: int) -> dict:
        return {"lastScaleDecision": {"time": "2026-01-01T00:00:00Z", "from": 1, "to": to, "reason": "test"}}

    # Only the status moved since the read (as the operator's own status updates do): retried, applied.
    body = cluster.get("infsvc", "occ")
    cluster.kubectl("patch", "infsvc", "occ", "--subresource=status", "--type=merge", "-p",
                    json.dumps({"status": {"observedMetrics": {"queueDepth": 1}}}))
    assert cluster.get("infsvc", "occ")["metadata"]["resourceVersion"] != body["metadata"]["resourceVersion"]
    assert loop.scale(body, decision(2), 2)
    now = cluster.get("infsvc", "occ")
    assert now["spec"]["replicas"] == 2 and now["status"]["lastScaleDecision"]["to"] == 2
    assert record.scaled_to == 2  # the update it causes is the autoscaler's
    record.scaled_to = None  # as the operator's reconcile of that update does (this loop has no handlers)

    # A human scaled since the read: their 4 stays, and the status still shows the last real decision.
    body = cluster.get("infsvc", "occ")
    cluster.kubectl("scale", "infsvc", "occ", "--replicas=4")
    assert not loop.scale(body, decision(3), 3)
    now = cluster.get("infsvc", "occ")
    assert now["spec"]["replicas"] == 4 and now["status"]["lastScaleDecision"]["to"] == 2
    assert record.scaled_to is None  # the dropped 3 is not claimed, nor is the human's 4
    # The precondition itself, as the apiserver enforces it.
    with pytest.raises(Conflict):
        kube.patch_replicas(cluster.ns, "occ", 1, resource_version=body["metadata"]["resourceVersion"])
    assert cluster.get("infsvc", "occ")["spec"]["replicas"] == 4


class LoadedEngines(FakeEngines):
    """Stand-ins whose counters grow as if `rate` requests a second of `prompt` prompt tokens
    (and 72 output tokens) arrived at every pod: the length mix the predictive policy reads."""

    def __init__(self, cluster: Cluster, name: str, rate: float):
        super().__init__(cluster, name)
        self.rate, self.prompt = rate, 144
        self.started, self.finished, self.prompt_tokens, self.lock = time.monotonic(), 0, 0, threading.Lock()

    def _text(self) -> str | None:
        with self.lock:
            due = int(self.rate * (time.monotonic() - self.started))
            self.prompt_tokens += (due - self.finished) * self.prompt
            self.finished = due
            finished, prompt_tokens = self.finished, self.prompt_tokens
        return engine_metrics_text(waiting=0, running=2, ttfts=[], finished=finished, prompt_tokens=prompt_tokens,
                                   generation_tokens=72 * finished)


def test_predictive_scales_up_on_longer_prompts_at_the_same_rate(cluster):
    model = {"a": 0.02, "b": 0.0015, "c": 0.0004, "cold_start_seconds": 5.0}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "engine-profile"},
        "data": {"model.json": json.dumps(model)}}))
    spec = {"replicas": 1, "autoscaling": {
        "enabled": True, "minReplicas": 1, "maxReplicas": 4, "targetConcurrencyPerReplica": 100,
        "targetP99LatencySeconds": 0.3, "scaleUpWindowSeconds": 4, "scaleDownStabilizationSeconds": 600,
        "maxStep": 2, "policy": "predictive", "profile": "engine-profile"}}
    cluster.kubectl("apply", "-f", "-", input=isvc("predict", **spec))
    wait_for("Ready", lambda: cluster.ready("predict"))
    with LoadedEngines(cluster, "predict", rate=2.0) as engines:
        wait_for("MetricsAvailable", lambda: cluster.condition_if("predict", "MetricsAvailable", "True"), timeout=20)
        time.sleep(8)  # 2 requests a second of 144-token prompts fit one replica by the model
        assert cluster.get("infsvc", "predict")["spec"]["replicas"] == 1, scaled(cluster, "predict")
        engines.prompt = 400  # the same rate, longer prompts: no queue, no latency seen, concurrency unchanged
        wait_for("a scale-up by the model", lambda: [m for m in scaled(cluster, "predict")
                                                    if "by the performance model" in m], timeout=60)
        assert cluster.get("infsvc", "predict")["spec"]["replicas"] > 1
