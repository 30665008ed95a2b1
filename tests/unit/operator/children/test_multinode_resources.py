"""Multi-node replicas (engine.nodesPerReplica > 1) render a LeaderWorkerSet instead of a Deployment:
its templates, group size and restart policy, a Service of the leaders, the group's NetworkPolicy."""
from __future__ import annotations

from kaon_operator import api, labels
from kaon_operator.children import leaderworkerset, resources
from kaon_operator.config import NetworkPolicyConfig

OWNER = resources.Owner("big", "ns", "uid-1")
NETWORK = NetworkPolicyConfig(release_namespace="kaon-system")


def _spec(nodes: int = 2, **extra) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({
        "model": {"uri": "hf://meta-llama/Llama-3.1-405B"}, "replicas": 3,
        "engine": {"nodesPerReplica": nodes, "pipelineParallelSize": nodes, "tensorParallelSize": 8}, **extra})


def _kinds(children: list[dict]) -> list[str]:
    return [c["kind"] for c in children]


def test_one_node_per_replica_is_a_deployment():
    children = resources.render(OWNER, _spec(nodes=1), NETWORK)
    assert _kinds(children) == ["Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    assert "--pipeline-parallel-size" not in children[0]["spec"]["template"]["spec"]["containers"][0]["args"]


def test_several_nodes_per_replica_are_a_leader_worker_set():
    children = resources.render(OWNER, _spec(), NETWORK)
    assert _kinds(children) == ["NetworkPolicy", "LeaderWorkerSet", "Service", "PodDisruptionBudget", "NetworkPolicy"]
    lws = children[1]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["replicas"] == 3
    template = lws["spec"]["leaderWorkerTemplate"]
    assert template["size"] == 2 and template["restartPolicy"] == "RecreateGroupOnPodRestart"
    leader, worker = template["leaderTemplate"], template["workerTemplate"]
    assert leader["metadata"]["labels"][labels.COMPONENT] == labels.ENGINE
    assert worker["metadata"]["labels"][labels.COMPONENT] == labels.ENGINE_WORKER
    lead, work = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    assert lead["args"] == work["args"]
    assert lead["args"][lead["args"].index("--pipeline-parallel-size") + 1] == "2"
    assert lead["resources"]["limits"][api.GPU_RESOURCE] == "8"  # one stage per node on tensorParallelSize GPUs
    assert "readinessProbe" in lead and "readinessProbe" not in work and "startupProbe" not in work
    assert work["livenessProbe"]["httpGet"]["path"] == "/health"  # a worker answers only /health
    assert lws["spec"]["rolloutStrategy"]["rollingUpdateConfiguration"] == {"maxSurge": 1, "maxUnavailable": 0}


def test_the_service_selects_leaders_and_the_group_may_talk_to_itself():
    children = {(c["kind"], c["metadata"]["name"]): c for c in resources.render(OWNER, _spec(), NETWORK)}
    selector = children[("Service", "big")]["spec"]["selector"]
    assert selector[leaderworkerset.WORKER_INDEX_LABEL] == "0"
    assert selector[labels.COMPONENT] == labels.ENGINE
    group = children[("NetworkPolicy", "big-group")]["spec"]
    assert group["podSelector"]["matchLabels"] == {labels.SERVICE: "big", leaderworkerset.NAME_LABEL: "big"}
    assert group["ingress"] == [{"from": [{"podSelector": {"matchLabels": group["podSelector"]["matchLabels"]}}]}]


def test_no_group_policy_with_network_policies_off():
    assert _kinds(resources.render(OWNER, _spec())) == ["LeaderWorkerSet", "Service", "PodDisruptionBudget"]


def test_pipeline_stages_must_match_the_nodes():
    refused = api.parse_spec({"model": {"uri": "/m"}, "engine": {"nodesPerReplica": 2}})
    assert isinstance(refused, str) and "pipelineParallelSize must equal nodesPerReplica" in refused


def test_the_status_counts_groups():
    summary = leaderworkerset.summarize({"metadata": {"generation": 3}, "spec": {"replicas": 2},
                                         "status": {"replicas": 2, "readyReplicas": 1, "updatedReplicas": 2}})
    assert (summary.replicas, summary.total, summary.ready, summary.updated) == (2, 2, 1, 2)


def test_leader_and_workers_read_the_groups_key_from_its_secret():
    """KAON_DIST_AUTHKEY from `<name>-dist-key` in both templates, over any value the spec's env gives."""
    spec = _spec(engine={"nodesPerReplica": 2, "pipelineParallelSize": 2,
                         "env": [{"name": "KAON_DIST_AUTHKEY", "value": "guessable"}]})
    template = resources.render(OWNER, spec, NETWORK)[1]["spec"]["leaderWorkerTemplate"]
    ref = {"secretKeyRef": {"name": "big-dist-key", "key": leaderworkerset.DIST_KEY_FIELD}}
    for role in ("leaderTemplate", "workerTemplate"):
        env = template[role]["spec"]["containers"][0]["env"]
        assert [e.get("valueFrom") for e in env if e["name"] == "KAON_DIST_AUTHKEY"] == [ref], role
    secret = resources.dist_key_secret(OWNER, "k" * 64)
    assert (secret["kind"], secret["metadata"]["name"], secret["stringData"]) == ("Secret", "big-dist-key",
                                                                                  {"authkey": "k" * 64})
    assert secret["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # it goes with the InferenceService
    deployment = resources.render(OWNER, _spec(nodes=1), NETWORK)[0]["spec"]["template"]["spec"]["containers"][0]
    assert all(e["name"] != "KAON_DIST_AUTHKEY" for e in deployment.get("env") or [])
