"""Multi-node replicas on the real control plane (issue 39): an InferenceService with
engine.nodesPerReplica 2 is a LeaderWorkerSet, never a Deployment.

First without the LeaderWorkerSet API (its CRD removed before the operator starts): a clear
condition naming what to install, a Warning Event, and no child at all. Then with LWS's CRD
(e2e/lws-crd.yaml) and the stand-in LWS controller (e2e/lws_standin.py, which makes the groups'
pods as LWS would; KWOK marks them Ready): the LeaderWorkerSet's templates, size and restart
policy, the Service of leaders, the group's NetworkPolicy, scaling in groups, status counting
ready groups, and a killed worker recreating its group with Warning Events."""
from __future__ import annotations

import base64

import pytest

from e2e.lws_standin import CRD_PATH as LWS_CRD, LwsStandIn
from e2e.operator_process import OperatorProcess
from kaon_operator import labels
from kaon_operator.children import leaderworkerset
from support.cluster import Cluster, isvc, wait_for

MULTI_NODE = {"nodesPerReplica": 2, "pipelineParallelSize": 2}


def _lws_served(cp) -> bool:
    return cp.kubectl("get", "leaderworkersets", "-A", check=False).returncode == 0


@pytest.fixture(scope="module")
def without_lws(crd):
    """The LWS CRD absent when the operator starts (an earlier run of this module installed it)."""
    crd.kubectl("delete", "crd", leaderworkerset.CRD_NAME, "--ignore-not-found", "--wait=true")
    wait_for("the LeaderWorkerSet API to be gone", lambda: not _lws_served(crd))
    return crd


@pytest.fixture(scope="module")
def operator(without_lws, operator_kubeconfig):
    proc = OperatorProcess(operator_kubeconfig, without_lws.workdir / "operator-multinode.log",
                           "--autoscale-interval", "1").start()
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def lws(operator, crd):
    """The LWS CRD installed while the operator runs, and the stand-in controller."""
    crd.kubectl("apply", "--server-side", "-f", str(LWS_CRD))
    crd.kubectl("wait", "--for=condition=Established", "--timeout=60s", f"crd/{leaderworkerset.CRD_NAME}")
    with LwsStandIn(crd.kubeconfig) as standin:
        yield standin


@pytest.fixture
def cluster(operator, crd, namespace) -> Cluster:
    return Cluster(crd, namespace)


def test_without_the_lws_api_a_clear_condition_and_nothing_made(cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("big", engine=MULTI_NODE))
    degraded = wait_for("the LeaderWorkerSetMissing condition", lambda: cluster.condition_if("big", "Degraded", "True"))
    assert degraded["reason"] == "LeaderWorkerSetMissing"
    assert "leaderworkerset.x-k8s.io/v1" in degraded["message"] and "kubectl apply" in degraded["message"]
    assert cluster.condition("big", "Ready")["reason"] == "LeaderWorkerSetMissing"
    wait_for("the Warning Event", lambda: any(
        t == "Warning" and r == "LeaderWorkerSetMissing" for t, r, _ in cluster.events("big")))
    for kind in ("deployment", "service", "poddisruptionbudget", "networkpolicy"):
        assert cluster.get(kind, selector="kaon.dev/inferenceservice=big") == [], kind


def _group_pods(cluster: Cluster, name: str) -> list[dict]:
    return cluster.get("pods", selector=f"{leaderworkerset.NAME_LABEL}={name}") or []


def _ready_groups(cluster: Cluster, name: str, groups: int) -> bool:
    status = cluster.status(name)
    return cluster.ready(name) and status.get("readyReplicas") == groups and status.get("replicas") == groups


def test_a_multi_node_replica_is_one_leader_worker_set_group(lws, cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("big", engine=MULTI_NODE))
    wait_for("one ready group", lambda: _ready_groups(cluster, "big", 1), timeout=60)
    assert cluster.get("deployment", "big") is None
    template = cluster.get("leaderworkerset", "big")["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader_args = template["leaderTemplate"]["spec"]["containers"][0]["args"]
    assert leader_args[leader_args.index("--pipeline-parallel-size") + 1] == "2"
    assert template["workerTemplate"]["metadata"]["labels"][labels.COMPONENT] == labels.ENGINE_WORKER

    pods = {p["metadata"]["labels"][leaderworkerset.WORKER_INDEX_LABEL]: p for p in _group_pods(cluster, "big")}
    assert sorted(pods) == ["0", "1"]
    env = {e["name"]: e.get("value") for e in pods["1"]["spec"]["containers"][0]["env"]}
    assert env["LWS_LEADER_ADDRESS"].startswith("big-0.big.") and env["LWS_GROUP_SIZE"] == "2"
    assert env["LWS_WORKER_INDEX"] == "1"
    selector = cluster.get("service", "big")["spec"]["selector"]
    assert selector[leaderworkerset.WORKER_INDEX_LABEL] == "0"
    selected = cluster.get("pods", selector=",".join(f"{k}={v}" for k, v in selector.items()))
    assert [p["metadata"]["name"] for p in selected] == ["big-0"]  # the leader only
    group_policy = cluster.get("networkpolicy", leaderworkerset.group_policy_name("big"))
    assert group_policy["spec"]["podSelector"]["matchLabels"][leaderworkerset.NAME_LABEL] == "big"

    cluster.kubectl("patch", "infsvc", "big", "--type=merge", "-p", '{"spec": {"replicas": 2}}')
    wait_for("two ready groups", lambda: _ready_groups(cluster, "big", 2), timeout=60)
    assert cluster.get("leaderworkerset", "big")["spec"]["replicas"] == 2
    assert len(_group_pods(cluster, "big")) == 4
    cluster.kubectl("patch", "infsvc", "big", "--type=merge", "-p", '{"spec": {"replicas": 1}}')
    wait_for("back to one group", lambda: _ready_groups(cluster, "big", 1) and len(_group_pods(cluster, "big")) == 2,
             timeout=60)


def test_a_killed_worker_recreates_its_group(lws, cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("big", engine=MULTI_NODE))
    wait_for("one ready group", lambda: _ready_groups(cluster, "big", 1), timeout=60)
    # The Event under test is Ready going True -> False: the service must be Ready first, not only its pods
    # (on a busy machine the operator can write Ready after the worker is already gone, and then no Event).
    wait_for("the service Ready", lambda: cluster.ready("big"), timeout=60)
    leader = cluster.get("pod", "big-0")["metadata"]["uid"]
    cluster.kubectl("delete", "pod", "big-0-1", "--wait=false")
    wait_for("a new leader (the whole group recreated)",
             lambda: (cluster.get("pod", "big-0") or {}).get("metadata", {}).get("uid") not in (None, leader))
    wait_for("the Warning Event of the lost group", lambda: any(
        t == "Warning" and r == "NotReady" for t, r, _ in cluster.events("big")), timeout=60)
    recreate = [e for e in cluster.get("events") or [] if e["reason"] == "RecreateGroupOnPodRestart"]
    assert recreate and recreate[0]["type"] == "Warning"
    wait_for("the group ready again", lambda: _ready_groups(cluster, "big", 1), timeout=60)


def test_switching_to_one_node_replaces_the_group_with_a_deployment(lws, cluster):
    cluster.kubectl("apply", "-f", "-", input=isvc("big", engine=MULTI_NODE))
    wait_for("one ready group", lambda: _ready_groups(cluster, "big", 1), timeout=60)
    cluster.kubectl("patch", "infsvc", "big", "--type=merge", "-p",
                    '{"spec": {"engine": {"nodesPerReplica": 1, "pipelineParallelSize": 1}}}')
    wait_for("the Deployment, and the LeaderWorkerSet gone",
             lambda: cluster.get("deployment", "big") and cluster.get("leaderworkerset", "big") is None, timeout=60)
    wait_for("ready on one node", lambda: cluster.ready("big") and not _group_pods(cluster, "big"), timeout=60)


def test_the_group_key_is_a_secret_of_the_service_made_once(lws, cluster):
    """KAON_DIST_AUTHKEY comes from `<name>-dist-key` (random, owned by the InferenceService) in the leader's
    and the workers' templates, and a change of the spec leaves the key as it was (no rotation under a group)."""
    cluster.kubectl("apply", "-f", "-", input=isvc("keyed", engine=MULTI_NODE))
    wait_for("one ready group", lambda: _ready_groups(cluster, "keyed", 1), timeout=60)
    secret = cluster.get("secret", leaderworkerset.dist_key_secret_name("keyed"))
    assert secret["metadata"]["ownerReferences"][0]["kind"] == "InferenceService"
    key = secret["data"][leaderworkerset.DIST_KEY_FIELD]
    assert len(base64.b64decode(key)) == 64
    template = cluster.get("leaderworkerset", "keyed")["spec"]["leaderWorkerTemplate"]
    for role in ("leaderTemplate", "workerTemplate"):
        env = {e["name"]: e for e in template[role]["spec"]["containers"][0]["env"]}
        assert env["KAON_DIST_AUTHKEY"]["valueFrom"]["secretKeyRef"] == {
            "name": "keyed-dist-key", "key": leaderworkerset.DIST_KEY_FIELD}, role
    cluster.kubectl("patch", "infsvc", "keyed", "--type=merge", "-p", '{"spec": {"replicas": 2}}')
    wait_for("two ready groups", lambda: _ready_groups(cluster, "keyed", 2), timeout=60)
    assert cluster.get("secret", "keyed-dist-key")["data"][leaderworkerset.DIST_KEY_FIELD] == key
