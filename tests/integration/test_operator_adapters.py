"""LoRA adapters against the real control plane: an adapter added to spec.adapters is loaded on the
running pod by the operator's adapter loop (POST /v1/load_lora_adapter), one removed is unloaded,
and neither restarts the pod; status.adapters lists the pods holding each; an adapter whose load
fails gets AdaptersReady False and a Warning Event naming it while the others load.

Engine pods are KWOK pods, so no engine runs in them: a stand-in serves each pod's adapter
endpoints on the pod's own IP and port (as in test_operator_autoscale.py). With real `kaon serve`
processes, MinIO and a PVC, through the router: tests/e2e/test_e2e_lora.py.
"""
from __future__ import annotations

import base64
import http.server
import json
import threading

import pytest

from kaon_operator.children import resources
from support.cluster import Cluster, isvc, wait_for

BROKEN = "hf://org/missing-adapter"


class StandIn(http.server.BaseHTTPRequestHandler):
    """An engine's /v1/models and load/unload endpoints, its adapters in `server.adapters`."""

    def _reply(self, status: int, body: dict | str) -> None:
        data = (json.dumps(body) if isinstance(body, dict) else body).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        held = self.server.adapters  # type: ignore[attr-defined]
        self._reply(200, {"object": "list", "data": [{"id": "base", "parent": None}] + [
            {"id": n, "parent": "base", "root": p} for n, p in held.items()]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        held = self.server.adapters  # type: ignore[attr-defined]
        # As `kaon serve --enable-runtime-lora`: the admin key of the pod's KAON_ADMIN_KEY, nothing else.
        if self.headers.get("Authorization") != f"Bearer {self.server.admin_key}":  # type: ignore[attr-defined]
            self._reply(401, {"error": {"message": "changing adapters needs the admin key"}})
            return
        if self.path == "/v1/load_lora_adapter":
            if body["lora_path"] == BROKEN:
                self._reply(400, {"error": {"message": "ModelNotFound: hf://org/missing-adapter does not exist"}})
                return
            held[body["lora_name"]] = body["lora_path"]
        else:
            held.pop(body["lora_name"], None)
        self._reply(200, "Success")

    def log_message(self, *args):
        pass


class StandIns:
    """A stand-in on the IP of every Running pod of one InferenceService, for the test's duration."""

    def __init__(self, cluster: Cluster, name: str):
        self.cluster, self.name = cluster, name
        self.servers: dict[str, http.server.ThreadingHTTPServer] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._follow_pods, daemon=True)

    def __enter__(self) -> StandIns:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for server in self.servers.values():
            server.shutdown()
            server.server_close()

    def held(self) -> list[dict]:
        return [dict(s.adapters) for s in self.servers.values()]  # type: ignore[attr-defined]

    def _follow_pods(self) -> None:
        while not self._stop.wait(0.3):
            for pod in self.cluster.running_pods(self.name):
                ip = pod["status"].get("podIP")
                if ip and ip not in self.servers:
                    server = http.server.ThreadingHTTPServer((ip, resources.HTTP_PORT), StandIn)
                    server.adapters = {}  # type: ignore[attr-defined]
                    server.admin_key = admin_key(self.cluster, self.name, pod)  # type: ignore[attr-defined]
                    threading.Thread(target=server.serve_forever, daemon=True).start()
                    self.servers[ip] = server


def admin_key(cluster: Cluster, name: str, pod: dict) -> str:
    """The key the pod's engine would take as KAON_ADMIN_KEY: from the Secret its env names."""
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert "--enable-runtime-lora" in engine["args"]
    ref = next(e for e in engine["env"] if e["name"] == "KAON_ADMIN_KEY")["valueFrom"]["secretKeyRef"]
    secret = cluster.get("secret", ref["name"])
    assert isinstance(secret, dict) and secret["metadata"]["ownerReferences"][0]["name"] == name
    return base64.b64decode(secret["data"][ref["key"]]).decode()


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


SQL = {"name": "sql", "uri": "s3://adapters/sql"}
CHAT = {"name": "chat", "uri": "hf://org/chat-lora"}


def test_an_added_adapter_is_loaded_on_the_running_pod_without_a_restart(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("lora", replicas=1, adapters=[SQL]))
    wait_for("Ready", lambda: cluster.ready("lora"))
    with StandIns(cluster, "lora") as engines:
        wait_for("sql loaded", lambda: engines.held() == [{"sql": SQL["uri"]}], timeout=40)
        pod = cluster.running_pods("lora")[0]["metadata"]
        # The pod's readiness gate, set by the operator's own ServiceAccount once sql is loaded (pods/status).
        wait_for("the adapters' readiness gate", lambda: any(
            c["type"] == "kaon.dev/adapters-loaded" and c["status"] == "True"
            for c in (cluster.get("pod", pod["name"]) or {}).get("status", {}).get("conditions") or ()), timeout=20)
        wait_for("status.adapters", lambda: cluster.status("lora").get("adapters") == [
            {"name": "sql", "pods": [pod["name"]]}], timeout=20)
        wait_for("AdaptersReady", lambda: cluster.condition_if("lora", "AdaptersReady", "True"), timeout=20)

        cluster.kubectl("apply", "-f", "-", input=isvc("lora", replicas=1, adapters=[SQL, CHAT]))
        wait_for("chat loaded too", lambda: engines.held() == [{"sql": SQL["uri"], "chat": CHAT["uri"]}],
                 timeout=40)
        cluster.kubectl("apply", "-f", "-", input=isvc("lora", replicas=1, adapters=[CHAT]))
        wait_for("sql unloaded", lambda: engines.held() == [{"chat": CHAT["uri"]}], timeout=40)
        # the same pod all along: no rollout, no restart
        after = cluster.running_pods("lora")
        assert [p["metadata"]["uid"] for p in after] == [pod["uid"]]
        assert not [c for c in after[0]["status"].get("containerStatuses") or [] if c.get("restartCount")]

        cluster.kubectl("apply", "-f", "-", input=isvc("lora", replicas=1, adapters=[
            CHAT, {"name": "broken", "uri": BROKEN}]))
        failed = wait_for("AdaptersReady False", lambda: cluster.condition_if("lora", "AdaptersReady", "False"),
                          timeout=40)
        assert "broken" in failed["message"] and "base model keeps serving" in failed["message"]
        wait_for("the Warning Event", lambda: [m for _, r, m in cluster.events("lora")
                                                if r == "AdapterLoadFailed" and "broken" in m], timeout=20)
        assert cluster.ready("lora") and engines.held() == [{"chat": CHAT["uri"]}]
