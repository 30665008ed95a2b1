"""A multi-node replica end to end on the local cluster (issue 39): an InferenceService with
nodesPerReplica 2 becomes one LeaderWorkerSet group of two real engine processes (`kaon serve
--pipeline-parallel-size 2`, one stage each, run by the pod runner on two KWOK nodes' pod IPs) that
find each other from LWS's environment, and answers through the router.

The LWS controller is the stand-in (e2e/lws_standin.py), which gives LWS_LEADER_ADDRESS as the
leader's pod IP: the local cluster has no DNS for LWS's headless Service."""
from __future__ import annotations

import pytest
from openai import OpenAI

from e2e.local_cluster import LOCAL_IMAGE, LocalCluster
from kaon_operator import leaderworkerset
from support.cluster import Cluster, isvc, wait_for

MODEL = {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2-pp"}


@pytest.fixture
def local(crd):
    with LocalCluster(crd, release="kaon-mn", leader_worker_sets=True) as local:
        yield local


def test_a_two_node_replica_serves_through_the_router(local, namespace):
    cluster = Cluster(local.cp, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc(
        "pp", model=MODEL, engine={"image": LOCAL_IMAGE, "nodesPerReplica": 2, "pipelineParallelSize": 2},
        resources={"requests": {"cpu": "100m", "memory": "256Mi"}}))
    wait_for("the group Ready", lambda: cluster.ready("pp") and cluster.status("pp").get("readyReplicas") == 1,
             timeout=420, interval=2)
    pods = cluster.get("pods", selector=f"{leaderworkerset.NAME_LABEL}=pp")
    assert sorted(p["metadata"]["name"] for p in pods) == ["pp-0", "pp-0-1"]
    assert all(p["status"]["phase"] == "Running" for p in pods)
    client = OpenAI(base_url=f"{local.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
    answer = client.completions.create(model="smollm2-pp", prompt="The capital of France is", max_tokens=8,
                                       temperature=0)
    assert answer.choices[0].text.strip()
