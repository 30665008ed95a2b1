"""A multi-node replica end to end on the local cluster (issue 39): an InferenceService with
nodesPerReplica 2 becomes one LeaderWorkerSet group of two real engine processes (`kaon serve
--pipeline-parallel-size 2`, one stage each, run by the pod runner on two KWOK nodes' pod IPs) that
find each other from LWS's environment, and answers through the router; then, under a burst of
clients, the autoscaler scales it to two groups (both answering through the router), and back to one
when the burst is over.

The LWS controller is the stand-in (e2e/lws_standin.py), which gives LWS_LEADER_ADDRESS as the
leader's pod IP: the local cluster has no DNS for LWS's headless Service."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
from openai import OpenAI

from e2e.local_cluster import LOCAL_IMAGE
from e2e.lws_standin import DISTRIBUTED_PORT
from kaon_operator.children import leaderworkerset, resources
from support.cluster import Cluster, isvc, wait_for

MODEL = {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2-pp"}
# Windows short enough for a test (the demo's): 2 sequences per engine, a queue of 2 per replica.
AUTOSCALING = {"enabled": True, "minReplicas": 1, "maxReplicas": 2, "targetQueueDepthPerReplica": 2,
               "scaleUpWindowSeconds": 2, "scaleDownStabilizationSeconds": 15, "maxStep": 1}


def test_a_two_node_replica_serves_through_the_router(local, namespace):
    cluster = Cluster(local.cp, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc(
        "pp", model=MODEL, engine={"image": LOCAL_IMAGE, "nodesPerReplica": 2, "pipelineParallelSize": 2,
                                   "maxNumSeqs": 2},
        autoscaling=AUTOSCALING, resources={"requests": {"cpu": "100m", "memory": "256Mi"}}))
    wait_for("the group Ready", lambda: cluster.ready("pp") and cluster.status("pp").get("readyReplicas") == 1,
             timeout=420, interval=2)
    pods = cluster.get("pods", selector=f"{leaderworkerset.NAME_LABEL}=pp")
    assert sorted(p["metadata"]["name"] for p in pods) == ["pp-0", "pp-0-1"]
    assert all(p["status"]["phase"] == "Running" for p in pods)
    client = OpenAI(base_url=f"{local.router_url}/v1", api_key="unused", timeout=120, max_retries=0)
    answer = client.completions.create(model="smollm2-pp", prompt="The capital of France is", max_tokens=8,
                                       temperature=0)
    assert answer.choices[0].text.strip()

    # 1 -> 2 groups under load: 8 clients keep requests in flight (4 per group's 2 sequences: a queue), so the
    # autoscaler asks for a second group. Its leader listens on a port of its own (the stand-in gives each
    # group one, since every pod here shares the host's network), and the router sends requests to both.
    stop = threading.Event()

    def keep_busy(i: int) -> None:
        while not stop.is_set():
            client.completions.create(model="smollm2-pp", prompt=f"Tell story number {i}.", max_tokens=16)

    def leaders() -> list[dict]:
        return [p for p in cluster.get("pods", selector=f"{leaderworkerset.NAME_LABEL}=pp") or []
                if p["metadata"]["labels"][leaderworkerset.WORKER_INDEX_LABEL] == "0" and p["status"].get("podIP")]

    with ThreadPoolExecutor(8) as pool:
        busy = [pool.submit(keep_busy, i) for i in range(8)]
        try:
            wait_for("two groups Ready under load", lambda: cluster.status("pp").get("readyReplicas") == 2,
                     timeout=420, interval=2)
            assert cluster.get("infsvc", "pp")["spec"]["replicas"] == 2  # the autoscaler's doing, not the test's
            assert len({p["metadata"]["annotations"][DISTRIBUTED_PORT] for p in leaders()}) == 2
            wait_for("both groups answering through the router",
                     lambda: len(leaders()) == 2 and all(_generated_tokens(p) > 0 for p in leaders()),
                     timeout=180, interval=1)
        finally:
            stop.set()
        for done in busy:
            done.result()  # a client's error fails the test here

    wait_for("back to one group once the burst is over", lambda: cluster.status("pp").get("readyReplicas") == 1
             and sorted(p["metadata"]["name"] for p in cluster.get("pods", selector=f"{leaderworkerset.NAME_LABEL}=pp")
                        or []) == ["pp-0", "pp-0-1"], timeout=240, interval=2)
    answer = client.completions.create(model="smollm2-pp", prompt="The capital of Italy is", max_tokens=4,
                                       temperature=0)
    assert answer.choices[0].text.strip()


def _generated_tokens(leader: dict) -> float:
    metrics = httpx.get(f"http://{leader['status']['podIP']}:{resources.HTTP_PORT}/metrics", timeout=10).text
    return sum(float(line.split()[-1]) for line in metrics.splitlines()
               if line.startswith("kaon_generation_tokens_total"))
