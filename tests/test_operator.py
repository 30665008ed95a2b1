"""The operator against a real control plane, running as its least-privilege ServiceAccount.

KWOK plays the kubelet: engine pods whose image is `kwok-ready/*` (STAND_IN, the default
here) go Running and Ready at once with no process behind them; other images fail the way a
kubelet would report (CrashLoopBackOff, OOMKilled, ImagePullBackOff) when their image says so,
and any other engine image never becomes Ready (e2e/kwok-stages.yaml). Everything else (apiserver validation, garbage collection,
the Deployment controller, the scheduler) is the real thing.
"""
from __future__ import annotations

import json
import time

import pytest

from kaon_operator import api

MODEL = {"uri": "builtin://smollm2-135m-instruct"}
STAND_IN = "kwok-ready/kaon:1"  # KWOK marks these engine pods Ready without running anything


def isvc(name: str, **spec) -> str:
    """An InferenceService; its engine image is the KWOK stand-in unless the spec names one."""
    engine = {"image": STAND_IN, **spec.pop("engine", {})}
    return json.dumps({"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name},
                       "spec": {"model": MODEL, "engine": engine, **spec}})


def wait_for(what: str, check, timeout: float = 30.0, interval: float = 0.3):
    """Poll `check` until it returns something truthy; fail with `what` and the last value."""
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(interval)
    pytest.fail(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


class Cluster:
    """kubectl as admin in one namespace, with the reads these tests repeat."""

    def __init__(self, cp, namespace: str):
        self.cp, self.ns = cp, namespace

    def kubectl(self, *args: str, **kw):
        return self.cp.kubectl("-n", self.ns, *args, **kw)

    def get(self, kind: str, name: str | None = None, selector: str | None = None) -> dict | list | None:
        args = ["get", kind] + ([name] if name else []) + (["-l", selector] if selector else [])
        res = self.kubectl(*args, "-o", "json", check=False)
        if res.returncode != 0:
            return None
        data = json.loads(res.stdout)
        return data["items"] if "items" in data else data

    def condition_if(self, name: str, type_: str, status: str) -> dict | None:
        """The condition when it has this status (one read, so the answer is consistent)."""
        cond = self.condition(name, type_)
        return cond if cond.get("status") == status else None

    def condition(self, name: str, type_: str) -> dict:
        status = (self.get("infsvc", name) or {}).get("status") or {}
        return next((c for c in status.get("conditions", []) if c["type"] == type_), {})

    def ready(self, name: str) -> bool:
        return self.condition(name, "Ready").get("status") == "True"

    def events(self, name: str) -> list[tuple[str, str, str]]:
        items = self.get("events") or []
        return [(e["type"], e["reason"], e["message"]) for e in items
                if e["involvedObject"]["kind"] == api.KIND and e["involvedObject"]["name"] == name]

    def pods(self, name: str) -> list[dict]:
        return self.get("pods", selector=f"kaon.dev/inferenceservice={name}") or []

    def running_pods(self, name: str) -> list[dict]:
        return [p for p in self.pods(name)
                if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")]


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def test_apply_creates_children_and_becomes_ready(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("smol", replicas=2))
    wait_for("Ready", lambda: cluster.ready("smol"))

    uid = cluster.get("infsvc", "smol")["metadata"]["uid"]
    for kind in ("deployment", "service", "poddisruptionbudget"):
        child = cluster.get(kind, "smol")
        assert child is not None, kind
        assert child["metadata"]["labels"]["app.kubernetes.io/instance"] == "smol"
        assert child["metadata"]["ownerReferences"][0]["uid"] == uid
    pods = cluster.running_pods("smol")
    assert len(pods) == 2 and all(p["status"]["podIP"].startswith("127.1.") for p in pods)
    assert pods[0]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"

    obj = cluster.get("infsvc", "smol")
    assert not obj["metadata"].get("finalizers")  # deleting it never waits for the operator
    status = obj["status"]
    assert status["readyReplicas"] == 2 and status["replicas"] == 2
    assert status["observedGeneration"] == 1
    assert status["url"] == f"http://smol.{cluster.ns}.svc:80"
    assert cluster.condition("smol", "Degraded")["status"] == "False"

    table = cluster.kubectl("get", "infsvc", "smol").stdout.splitlines()
    assert table[0].split()[:4] == ["NAME", "READY", "DESIRED", "MODEL"]
    assert table[1].split()[:4] == ["smol", "2", "2", MODEL["uri"]]
    described = cluster.kubectl("describe", "infsvc", "smol").stdout
    assert "Created" in described and "created Deployment smol, Service smol, PodDisruptionBudget smol" in described
    assert "2/2 replicas ready" in described and "kaon-operator" in described


def test_spec_change_rolls_out_and_scale_changes_replicas(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("roll"))
    wait_for("Ready", lambda: cluster.ready("roll"))
    old_pod = cluster.running_pods("roll")[0]["metadata"]["name"]

    cluster.kubectl("patch", "infsvc", "roll", "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"image": "kwok-ready/kaon:next"}}}))
    wait_for("the new pod to replace the old one", lambda: [
        p for p in cluster.running_pods("roll")] and all(
        p["spec"]["containers"][0]["image"] == "kwok-ready/kaon:next" for p in cluster.running_pods("roll")))
    assert old_pod not in [p["metadata"]["name"] for p in cluster.running_pods("roll")]
    assert any(r == "RollingOut" and "engine.image" in m for _, r, m in cluster.events("roll"))
    wait_for("the RolloutComplete event", lambda: any(r == "RolloutComplete" for _, r, _m in cluster.events("roll")))
    wait_for("observedGeneration 2", lambda: cluster.get("infsvc", "roll")["status"].get("observedGeneration") == 2)

    cluster.kubectl("scale", "infsvc", "roll", "--replicas=3")
    wait_for("3 ready replicas", lambda: cluster.get("infsvc", "roll")["status"].get("readyReplicas") == 3)
    assert cluster.get("deployment", "roll")["spec"]["replicas"] == 3
    assert ("Normal", "Scaled", "Scaled 1 → 3 (spec.replicas)") in cluster.events("roll")
    assert cluster.ready("roll")


def test_deleting_the_inference_service_removes_every_child(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("gone", replicas=2))
    wait_for("Ready", lambda: cluster.ready("gone"))
    cluster.kubectl("delete", "infsvc", "gone", "--wait=true", "--timeout=30s")
    for kind in ("deployment", "service", "poddisruptionbudget", "replicaset"):
        wait_for(f"the {kind} to be collected", lambda: not cluster.get(kind, selector="kaon.dev/inferenceservice=gone"))
    wait_for("the pods to go", lambda: not cluster.pods("gone"))


@pytest.mark.parametrize("kind", ["deployment", "service", "poddisruptionbudget"])
def test_a_child_deleted_by_hand_is_recreated(cluster, kind):
    cluster.kubectl("apply", "-f", "-", input=isvc("keep"))
    wait_for("Ready", lambda: cluster.ready("keep"))
    before = cluster.get(kind, "keep")["metadata"]["uid"]
    cluster.kubectl("delete", kind, "keep", "--wait=true")
    after = wait_for(f"the {kind} to come back", lambda: (cluster.get(kind, "keep") or {}).get("metadata"))
    assert after["uid"] != before
    assert any(r == "Repaired" and "was deleted; recreated it" in m for _, r, m in cluster.events("keep"))
    wait_for("Ready again", lambda: cluster.ready("keep"))


def test_an_edited_child_is_put_back(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("edit", replicas=2))
    wait_for("Ready", lambda: cluster.ready("edit"))
    cluster.kubectl("scale", "deployment", "edit", "--replicas=5")
    cluster.kubectl("set", "image", "deployment/edit", "engine=example.com/hacked:1")

    def restored():
        spec = cluster.get("deployment", "edit")["spec"]
        return spec["replicas"] == 2 and spec["template"]["spec"]["containers"][0]["image"] == STAND_IN
    wait_for("the Deployment to be put back", restored)
    assert any(r == "Repaired" and "was edited by" in m for _, r, m in cluster.events("edit"))
    wait_for("2 running pods on the right image", lambda: len(cluster.running_pods("edit")) == 2 and all(
        p["spec"]["containers"][0]["image"] == STAND_IN for p in cluster.running_pods("edit")))


def test_more_gpus_than_any_node_has_is_degraded_unschedulable(cluster):
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=isvc("huge", engine={"tensorParallelSize": 16}))
    degraded = wait_for("Degraded", lambda: cluster.condition_if("huge", "Degraded", "True"), timeout=20)
    assert time.monotonic() - start < 20
    assert degraded["reason"] == "Unschedulable"
    assert "16 nvidia.com/gpu" in degraded["message"] and "Insufficient nvidia.com/gpu" in degraded["message"]
    assert cluster.condition("huge", "Ready")["status"] == "False"
    assert all(p["status"]["phase"] == "Pending" for p in cluster.pods("huge"))
    warnings = [(r, m) for t, r, m in cluster.events("huge") if t == "Warning"]
    assert warnings and warnings[0][0] == "Unschedulable"

    # Recovery: a size that fits gets scheduled, and the condition and an Event say so.
    cluster.kubectl("patch", "infsvc", "huge", "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"tensorParallelSize": 8}}}))
    wait_for("Ready", lambda: cluster.ready("huge"), timeout=40)
    wait_for("not Degraded", lambda: cluster.condition("huge", "Degraded").get("status") == "False")
    assert any(r == "Recovered" for _, r, _m in cluster.events("huge"))


def test_a_refused_child_is_degraded_apply_failed_then_retried(cluster):
    cluster.kubectl("create", "quota", "no-services", "--hard=services=0")
    cluster.kubectl("apply", "-f", "-", input=isvc("quota"))
    degraded = wait_for("Degraded", lambda: cluster.condition_if("quota", "Degraded", "True"))
    assert degraded["reason"] == "ApplyFailed" and "services" in degraded["message"], degraded
    assert ("Warning", "ApplyFailed") in [(t, r) for t, r, _m in cluster.events("quota")]
    wait_for("the Deployment's pod up", lambda: cluster.running_pods("quota"))
    time.sleep(2)  # pod events since must not have cleared the failure
    assert cluster.condition("quota", "Degraded")["reason"] == "ApplyFailed"
    cluster.kubectl("delete", "quota", "no-services")
    wait_for("the Service after the retry", lambda: cluster.get("service", "quota"), timeout=40)
    wait_for("Ready and not Degraded", lambda: cluster.ready("quota") and
             cluster.condition("quota", "Degraded").get("status") == "False")


@pytest.mark.parametrize("image, reason, cause", [
    ("kwok-fail/crashloop:1", "CrashLoopBackOff", "exited with code 2 (4 restart(s)): kaon: error: the engine could not start"),
    ("kwok-fail/oom:1", "OOMKilled", "killed for using more memory than its limit (exit code 137"),
    ("kwok-fail/image-pull:1", "ImagePullBackOff", 'Back-off pulling image "kwok-fail/image-pull:1"')])
def test_failing_pods_make_it_degraded_with_the_kubelet_reason_then_recover(cluster, image, reason, cause):
    start = time.monotonic()
    cluster.kubectl("apply", "-f", "-", input=isvc("bad", engine={"image": image}))
    degraded = wait_for("Degraded", lambda: cluster.condition_if("bad", "Degraded", "True"), timeout=15)
    assert time.monotonic() - start < 15
    assert degraded["reason"] == reason and "bad-" in degraded["message"], degraded  # names the failing pod
    assert cause in degraded["message"], degraded  # the cause, without opening a pod log
    assert cluster.condition("bad", "Ready")["status"] == "False"
    assert ("Warning", reason, degraded["message"]) in cluster.events("bad")
    assert "Reason:" in cluster.kubectl("describe", "infsvc", "bad").stdout and cause in " ".join(
        cluster.kubectl("describe", "infsvc", "bad").stdout.split())

    cluster.kubectl("patch", "infsvc", "bad", "--type=merge", "-p", json.dumps({"spec": {"engine": {"image": STAND_IN}}}))
    wait_for("not Degraded", lambda: cluster.condition_if("bad", "Degraded", "False"), timeout=30)
    assert ("Normal", "Recovered", f"no longer degraded ({reason})") in cluster.events("bad")
    assert [r for t, r, _m in cluster.events("bad") if t == "Warning"] == [reason]  # once, not per pod update


def test_an_image_the_local_cluster_cannot_run_never_looks_ready(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("norun", engine={"image": api.DEFAULT_IMAGE}))
    wait_for("the pod Running", lambda: cluster.running_pods("norun"))
    time.sleep(2)
    pod = cluster.running_pods("norun")[0]
    ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "NoContainerRuntime", ready
    assert "runs only local/*" in ready["message"]
    assert cluster.condition("norun", "Ready")["status"] == "False"
    assert cluster.get("infsvc", "norun")["status"].get("readyReplicas", 0) == 0


def test_pods_refused_by_a_quota_are_degraded_failed_create_then_recover(cluster):
    cluster.kubectl("create", "quota", "no-pods", "--hard=pods=0")
    cluster.kubectl("apply", "-f", "-", input=isvc("refused"))
    degraded = wait_for("Degraded", lambda: cluster.condition_if("refused", "Degraded", "True"), timeout=20)
    assert degraded["reason"] == "FailedCreate", degraded
    assert "the ReplicaSet cannot create pods" in degraded["message"] and "exceeded quota: no-pods" in degraded["message"]
    assert ("Warning", "FailedCreate", degraded["message"]) in cluster.events("refused")
    cluster.kubectl("delete", "quota", "no-pods")
    wait_for("Ready and not Degraded", lambda: cluster.ready("refused") and
             cluster.condition("refused", "Degraded").get("status") == "False", timeout=60)
    assert ("Normal", "Recovered", "no longer degraded (FailedCreate)") in cluster.events("refused")


def test_a_pod_not_ready_past_its_startup_budget_is_degraded_startup_timeout(cluster):
    """The operator's own pods allow 30 minutes; a pod of the service with a 2 s startup probe
    (and an image nothing runs) stands in for a model too slow to load."""
    cluster.kubectl("apply", "-f", "-", input=isvc("slow"))
    wait_for("Ready", lambda: cluster.ready("slow"))
    labels = cluster.get("deployment", "slow")["spec"]["template"]["metadata"]["labels"]
    probe = {"httpGet": {"path": "/health", "port": 8000}, "periodSeconds": 1, "failureThreshold": 2}
    cluster.kubectl("apply", "-f", "-", input=json.dumps({
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "slow-extra", "labels": labels},
        "spec": {"containers": [{"name": "engine", "image": api.DEFAULT_IMAGE, "startupProbe": probe,
                                 "readinessProbe": {**probe, "failureThreshold": 1}}]}}))
    start = time.monotonic()
    degraded = wait_for("Degraded", lambda: cluster.condition_if("slow", "Degraded", "True"), timeout=20)
    assert time.monotonic() - start < 15  # 3 s of budget, judged every 5 s
    assert degraded["reason"] == "StartupTimeout", degraded
    assert "not ready after the 3 s their probes allow" in degraded["message"] and "slow-extra" in degraded["message"]
    assert ("Warning", "StartupTimeout", degraded["message"]) in cluster.events("slow")
    time.sleep(6)  # judged again: no second Event for the same failure
    assert [r for t, r, _m in cluster.events("slow") if t == "Warning"] == ["StartupTimeout"]
    cluster.kubectl("delete", "pod", "slow-extra", "--wait=false")
    wait_for("not Degraded", lambda: cluster.condition_if("slow", "Degraded", "False"), timeout=20)
    assert ("Normal", "Recovered", "no longer degraded (StartupTimeout)") in cluster.events("slow")


def test_killed_mid_reconcile_then_restarted_converges_without_duplicates(operator, cluster):
    names = [f"crash{i}" for i in range(6)]
    cluster.kubectl("apply", "-f", "-", input="\n---\n".join(isvc(n) for n in names))
    wait_for("the first Deployment", lambda: cluster.get("deployments"), interval=0.05)
    operator.kill()  # SIGKILL: no cleanup, kopf's progress annotations as they were
    try:
        for name in names:  # edits made while it is down must be picked up too
            cluster.kubectl("patch", "infsvc", name, "--type=merge", "-p", '{"spec": {"replicas": 2}}')
    finally:
        operator.start()
    for name in names:
        wait_for(f"{name} Ready", lambda: cluster.ready(name) and
                 cluster.get("infsvc", name)["status"]["readyReplicas"] == 2, timeout=60)
    deployments = cluster.get("deployments")
    assert sorted(d["metadata"]["name"] for d in deployments) == names
    assert len(cluster.get("replicasets")) == len(names)  # no rollout happened, none doubled
    assert len(cluster.get("services")) == len(names) and len(cluster.get("poddisruptionbudgets")) == len(names)
    assert sorted(len(cluster.running_pods(n)) for n in names) == [2] * len(names)


def test_the_operator_identity_has_only_what_it_needs(crd, operator_kubeconfig, operator):
    def can(verb: str, resource: str) -> bool:
        res = crd.kubectl("auth", "can-i", verb, resource, "--all-namespaces", kubeconfig=operator_kubeconfig,
                          check=False)
        return res.stdout.strip() == "yes"
    for verb, resource in [("watch", "inferenceservices.kaon.dev"), ("patch", "inferenceservices.kaon.dev/status"),
                           ("patch", "deployments.apps"), ("create", "events"), ("list", "pods")]:
        assert can(verb, resource), (verb, resource)
    for verb, resource in [("get", "secrets"), ("delete", "deployments.apps"), ("create", "pods"),
                           ("delete", "inferenceservices.kaon.dev"), ("update", "nodes"), ("create", "roles")]:
        assert not can(verb, resource), (verb, resource)
    # Everything above ran under this identity: any request it was refused shows up here.
    assert "system:serviceaccount:kaon-system:kaon-operator\" cannot" not in operator.log(100_000)
