"""Multi-node replicas (spec.engine.nodesPerReplica > 1): one replica is one group of a
LeaderWorkerSet (leaderworkerset.x-k8s.io/v1, the Kubernetes SIG project, installed
separately): a leader pod (the scheduler, the HTTP server, pipeline stage 0) and
nodesPerReplica - 1 worker pods (the other stages), created, restarted and scaled together.

Pure functions: the LeaderWorkerSet's manifest, the Secret of the group's control-channel key
(`<name>-dist-key`, made once by the reconciler and never rewritten, so a running group keeps its
key), the NetworkPolicy between a group's pods, and the summary of its status. The LWS controller
gives every pod LWS_LEADER_ADDRESS, LWS_GROUP_SIZE, LWS_WORKER_INDEX and LWS_NAME, from which the
engine's ranks find each other (docs/multinode.md, "engine contract"); the operator talks to the
LeaderWorkerSet API only.
"""
from __future__ import annotations

from collections.abc import Mapping

from kaon_operator import api, labels
from kaon_operator.children import pod_template
from kaon_operator.status.summaries import DeploymentSummary

GROUP, VERSION, PLURAL, KIND = "leaderworkerset.x-k8s.io", "v1", "leaderworkersets", "LeaderWorkerSet"
API_VERSION = f"{GROUP}/{VERSION}"
CRD_NAME = f"{PLURAL}.{GROUP}"
INSTALL_HINT = ("install the LeaderWorkerSet controller and its CRD: kubectl apply --server-side -f "
                "https://github.com/kubernetes-sigs/lws/releases/download/<version>/manifests.yaml "
                "(https://lws.sigs.k8s.io/docs/installation/)")

# The labels and annotations the LWS controller puts on a group's pods.
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_INDEX_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"  # "0" on the leader
GROUP_KEY_LABEL = "leaderworkerset.sigs.k8s.io/group-key"
SIZE_ANNOTATION = "leaderworkerset.sigs.k8s.io/size"
LEADER_NAME_ANNOTATION = "leaderworkerset.sigs.k8s.io/leader-name"
LEADER_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_NAME")
RESTART_POLICY = "RecreateGroupOnPodRestart"  # a pipeline missing one stage cannot serve: the group restarts whole
# The engine's control channel carries pickled step plans: its key comes from a Secret per InferenceService
# (the engine refuses a group of several hosts without one).
DIST_KEY_ENV, DIST_KEY_FIELD = "KAON_DIST_AUTHKEY", "authkey"


def leader_selector(name: str) -> dict[str, str]:
    """The leaders of the InferenceService `name`'s groups: what its Service selects."""
    return {**labels.engine_selector(name), WORKER_INDEX_LABEL: "0"}


def dist_key_secret_name(name: str) -> str:
    return f"{name}-dist-key"


def dist_key_secret(metadata: dict, name: str, key: str) -> dict:
    """The Secret holding the group's control-channel key `key` (random, from the reconciler)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {**metadata, "name": dist_key_secret_name(name)}, "stringData": {DIST_KEY_FIELD: key}}


def _with_dist_key(pod: dict, name: str) -> dict:
    """Every container of `pod` reads KAON_DIST_AUTHKEY from the group's Secret (over any value in the spec)."""
    ref = {"name": DIST_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": dist_key_secret_name(name),
                                                                "key": DIST_KEY_FIELD}}}
    containers = [{**c, "env": [*(e for e in c.get("env") or [] if e["name"] != DIST_KEY_ENV), ref]}
                  for c in pod["containers"]]
    return {**pod, "containers": containers}


def _worker_pod_spec(leader: dict) -> dict:
    """A worker runs `kaon serve` as the leader does (LWS_WORKER_INDEX tells it its stage) but serves only
    GET /health, from its start: the liveness probe stays, the startup and readiness probes go (the group
    is ready when its leader is, which needs every stage joined; nor the adapters' readiness gate: the
    leader holds the adapters). A dead worker is seen by the leader, whose
    /health then fails, and by the kubelet, which makes the LWS controller recreate the whole group."""
    container = {k: v for k, v in leader["containers"][0].items() if k not in ("startupProbe", "readinessProbe")}
    return {**{k: v for k, v in leader.items() if k != "readinessGates"}, "containers": [container]}


def manifest(metadata: dict, name: str, spec: api.InferenceServiceSpec) -> dict:
    """The LeaderWorkerSet of the InferenceService `name`: spec.replicas groups of nodesPerReplica pods."""
    leader = _with_dist_key(pod_template.pod_spec(name, spec), name)
    return {
        "apiVersion": API_VERSION, "kind": KIND, "metadata": metadata,
        "spec": {
            "replicas": spec.replicas,
            "startupPolicy": "LeaderCreated",  # the workers start with the leader: they load their stages meanwhile
            "rolloutStrategy": {"type": "RollingUpdate",
                                "rollingUpdateConfiguration": dict(api.ROLLING_UPDATES[spec.rollout.strategy])},
            "leaderWorkerTemplate": {
                "size": spec.engine.nodes_per_replica,
                "restartPolicy": RESTART_POLICY,
                "leaderTemplate": {"metadata": {"labels": labels.service_labels(name)}, "spec": leader},
                "workerTemplate": {"metadata": {"labels": labels.service_labels(name, labels.ENGINE_WORKER)},
                                   "spec": _worker_pod_spec(leader)},
            },
        },
    }


def group_network_policy(metadata: dict, name: str) -> dict:
    """The pods of one LeaderWorkerSet take every connection from each other (the stages' activations,
    the distributed init); the engine port's own policy (resources.network_policy) stays the leaders'."""
    peers = {"podSelector": {"matchLabels": {labels.SERVICE: name, NAME_LABEL: name}}}
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {**metadata, "name": group_policy_name(name)},
        "spec": {"podSelector": {"matchLabels": {labels.SERVICE: name, NAME_LABEL: name}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [peers]}]},
    }


def group_policy_name(name: str) -> str:
    return f"{name}-group"


def summarize(body: Mapping) -> DeploymentSummary:
    """A LeaderWorkerSet's status, counted in groups, in the Deployment's terms (conditions.py judges both).
    Its status carries no observedGeneration: the controller's Progressing condition stands in."""
    meta, spec, status = body.get("metadata") or {}, body.get("spec") or {}, body.get("status") or {}
    generation = meta.get("generation") or 0
    ready = status.get("readyReplicas") or 0
    return DeploymentSummary(generation=generation, observed_generation=generation,
                             replicas=spec.get("replicas") or 0, total=status.get("replicas") or 0,
                             updated=status.get("updatedReplicas") or 0, ready=ready, available=ready)
