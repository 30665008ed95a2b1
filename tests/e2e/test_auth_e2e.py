"""API keys and tenancy end to end on the local cluster (e2e/local_cluster.py): the operator and
the router as their own ServiceAccounts, each engine pod a real `kaon serve` on the pod's IP
(e2e/pod_runner.py, which also refreshes Secret volumes the way the kubelet does).

- spec.auth: no key and a wrong key are refused at the router (a 404, as for a model that does not
  exist, or a 401 on the headers while every served model needs a key) and a 401 at the engine's pod IP;
  the Secret's key passes both; a rotated key (the Secret edited) is accepted and the old one
  refused, with the same pod and no restart.
- Tenancy, with a router run with its defaults (default namespace `default`, no cluster-wide
  names): another namespace's model by its bare name is a 404, by `namespace/name` a 200.
- Two InferenceServices of one namespace serving one name: the later one gets NameConflict with
  a Warning, and loses it (Normal NameConflictResolved) once the older one is deleted.
"""
from __future__ import annotations

import hashlib
import json
import urllib.error
import urllib.request

from e2e.local_cluster import LOCAL_IMAGE, NAMESPACE, RouterProcess
from kaon_operator.children import resources
from support.cluster import Cluster, isvc, wait_for

MODEL = {"uri": "builtin://smollm2-135m-instruct"}


def post(url: str, body: dict, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def refused_at_router(status: int, answer: dict) -> bool:
    """The router's refusal of a caller without one of the model's keys: the same 404 as for no such
    model (names cannot be probed), or a 401 on the headers while every model it serves needs a key."""
    return (status, (answer.get("error") or {}).get("code")) in ((404, "model_not_found"), (401, "invalid_api_key"))


def set_keys(cluster: Cluster, **keys: str) -> None:
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "api-keys"}, "stringData": keys}
    cluster.kubectl("delete", "secret", "api-keys", "--ignore-not-found")  # stringData merges; start clean
    cluster.kubectl("apply", "-f", "-", input=json.dumps(secret))


def test_keys_are_required_at_the_router_and_the_pod_ip_and_rotate_without_a_restart(local, crd, namespace):
    cluster = Cluster(crd, namespace)
    served = f"guarded-{namespace}"  # the local cluster's router serves bare names of every test namespace
    set_keys(cluster, ci="key-one")
    cluster.kubectl("apply", "-f", "-", input=isvc(
        "guarded", model={**MODEL, "servedName": served}, engine={"image": LOCAL_IMAGE, "maxNumSeqs": 2},
        auth={"apiKeySecret": "api-keys"}))
    wait_for("Ready (a real engine loaded the model)", lambda: cluster.ready("guarded"), timeout=180)
    (pod,) = cluster.running_pods("guarded")
    direct = f"http://{pod['status']['podIP']}:{resources.HTTP_PORT}/v1/completions"
    routed = f"{local.router_url}/v1/completions"
    body = {"model": served, "prompt": "The capital of France is", "max_tokens": 2, "temperature": 0}

    assert refused_at_router(*post(routed, body))
    assert refused_at_router(*post(routed, body, "key-two"))
    status, answer = post(direct, body)  # around the router, straight to the engine: locked too
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"
    assert post(direct, body, "key-two")[0] == 401
    assert post(routed, body, "key-one")[0] == 200
    assert post(direct, body, "key-one")[0] == 200

    set_keys(cluster, ci="key-two")  # rotation: the Secret edited, nothing restarted
    # Polls until both the router (the digests the operator publishes in the status) and the engine
    # (its re-read volume) took the new key.
    wait_for("the rotated key accepted", lambda: post(routed, body, "key-two")[0] == 200
             and post(direct, body, "key-two")[0] == 200, timeout=60)
    assert refused_at_router(*post(routed, body, "key-one"))
    assert post(direct, body, "key-one")[0] == 401
    guarded = cluster.get("inferenceservice", "guarded")  # what the router reads: digests, never a key
    assert guarded["status"]["auth"]["keyDigests"] == [hashlib.sha256(b"key-two").hexdigest()]
    assert "key-two" not in json.dumps(guarded)
    (after,) = cluster.running_pods("guarded")
    assert after["metadata"]["uid"] == pod["metadata"]["uid"]
    assert all(c.get("restartCount", 0) == 0 for c in after["status"].get("containerStatuses") or [])

    cluster.kubectl("delete", "secret", "api-keys")  # gone: closed, never open
    wait_for("a missing Secret refuses", lambda: refused_at_router(*post(routed, body, "key-two")), timeout=30)
    # The router's own refusal, not only the engine's (its volume emptied too): no digest published.
    wait_for("no digest published", lambda: cluster.get("inferenceservice", "guarded")["status"]["auth"]
             == {"apiKeySecret": "api-keys", "keyDigests": []}, timeout=30)
    wait_for("a Warning Event NoApiKeys", lambda: "NoApiKeys" in cluster.kubectl("get", "events", "-o", "json").stdout)


def test_another_namespaces_model_needs_its_namespace_and_a_taken_name_is_a_condition(local, crd, namespace):
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc(
        "chat", model={**MODEL, "servedName": "chat"}, engine={"image": LOCAL_IMAGE, "maxNumSeqs": 2}))
    # A router with the defaults: bare names resolve in `default` only.
    name = local.release  # the chart's ServiceAccounts are named after it
    router = RouterProcess(local.cp.service_account_kubeconfig(NAMESPACE, f"{name}-router"),
                           local.cp.workdir / "router-defaults.log").start()
    try:
        wait_for("Ready (a real engine loaded the model)", lambda: cluster.ready("chat"), timeout=180)
        url = f"{router.url}/v1/completions"
        body = {"prompt": "Hello", "max_tokens": 2}
        status, answer = post(url, {"model": "chat", **body})
        assert status == 404 and answer["error"]["code"] == "model_not_found" and answer["error"]["param"] == "model"
        assert "<namespace>/<name>" in answer["error"]["message"]
        wait_for("the qualified name served", lambda: post(url, {"model": f"{namespace}/chat", **body})[0] == 200)
        status, answer = post(url, {"model": f"{namespace}/chat", **body})
        assert answer["model"] == "chat"  # the engine answered under its own served name
        assert post(url, {"model": f"{namespace}-elsewhere/chat", **body})[0] == 404
    finally:
        router.stop()

    # Two of one namespace serving one name: test_operator.isvc's KWOK stand-in image, no engine process.
    cluster.kubectl("apply", "-f", "-", input=isvc("first", model={**MODEL, "servedName": "dup"}))
    wait_for("the first created", lambda: cluster.get("infsvc", "first"))
    cluster.kubectl("apply", "-f", "-", input=isvc("second", model={**MODEL, "servedName": "dup"}))
    conflict = wait_for("NameConflict on the later one", lambda: cluster.condition_if("second", "NameConflict", "True"))
    assert conflict["reason"] == "ServedNameTaken" and "first" in conflict["message"]
    assert cluster.condition("first", "NameConflict") == {}
    wait_for("a Warning Event", lambda: any(t == "Warning" and r == "NameConflict"
                                            for t, r, _ in cluster.events("second")))
    cluster.kubectl("delete", "infsvc", "first")
    wait_for("the conflict resolved", lambda: cluster.condition("second", "NameConflict") == {} and
             any(t == "Normal" and r == "NameConflictResolved" for t, r, _ in cluster.events("second")))
