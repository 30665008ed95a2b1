"""Pure functions from an InferenceService to the manifests of its children: Deployment (or, with
several nodes per replica, a LeaderWorkerSet: leaderworkerset.py), Service, PodDisruptionBudget
and NetworkPolicy (the engine pod itself: pod_template.py).

No I/O: the reconciler server-side applies what `render()` returns. Every child carries the
labels of labels.py and an owner reference, so deleting the InferenceService garbage-collects it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kaon_operator import api, labels
from kaon_operator.autoscaling import standby
from kaon_operator.children import kv_cache_args, leaderworkerset, node_prefetch, pod_template, prefill_pool
from kaon_operator.children.pod_template import HTTP_PORT
from kaon_operator.config import NetworkPolicyConfig
from kaon_operator.lora import adapter_pods

SERVICE_PORT = 80


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService that owns the children."""

    name: str
    namespace: str
    uid: str




def selector(name: str) -> str:
    """The engine pods' selector as a string, for status.selector (scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in labels.engine_selector(name).items())


def owner_reference(owner: Owner) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: Owner) -> dict:
    return {"name": owner.name, "namespace": owner.namespace, "labels": labels.service_labels(owner.name),
            "ownerReferences": [owner_reference(owner)]}


def deployment(owner: Owner, spec: api.InferenceServiceSpec) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": standby.deployment_replicas(spec),  # spec.replicas, and the standbys behind them
            "selector": {"matchLabels": labels.engine_selector(owner.name)},
            # One pod at a time either way: Surge starts the new one first (capacity never dips, one
            # replica's GPUs must be free), Replace stops an old one first (works in a full GPU pool).
            "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(api.ROLLING_UPDATES[spec.rollout.strategy])},
            # Loading a big model legitimately takes the startup probe's whole budget.
            "progressDeadlineSeconds": pod_template.progress_deadline_seconds(spec),
            "template": {"metadata": {"labels": labels.service_labels(owner.name)},
                         "spec": pod_template.pod_spec(owner.name, spec)},
        },
    }


def service(owner: Owner, spec: api.InferenceServiceSpec | None = None) -> dict:
    """Selects the engine pods; of a multi-node replica only the leader serves HTTP."""
    multi_node = spec is not None and spec.engine.multi_node
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {"type": "ClusterIP",
                 "selector": leaderworkerset.leader_selector(owner.name) if multi_node
                 else labels.engine_selector(owner.name),
                 "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }


def min_available(spec: api.InferenceServiceSpec) -> int:
    """Replicas a voluntary disruption (node drain) must leave running.

    The floor is autoscaling.minReplicas (or spec.replicas without autoscaling), but
    never all of the current replicas: a PDB that allows no eviction blocks node drains.
    """
    floor = spec.autoscaling.min_replicas if spec.autoscaling.enabled else spec.replicas
    return max(0, min(floor, spec.replicas - 1))


def pod_disruption_budget(owner: Owner, spec: api.InferenceServiceSpec) -> dict:
    return {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": _metadata(owner),
        "spec": {"minAvailable": min_available(spec), "selector": {"matchLabels": labels.engine_selector(owner.name)}},
    }


def network_policy(owner: Owner, config: NetworkPolicyConfig, spec: api.InferenceServiceSpec | None = None) -> dict:
    """Engine pods take connections on the engine port only from kaon's router and operator pods in the
    release namespace (and config.extra_from). Only ingress: the engines' downloads (hf://, s3://) go out."""
    release = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.release_namespace}}}
    peers = [{**release, "podSelector": {"matchLabels": labels.component_labels(labels.ROUTER)}},
             {**release, "podSelector": {"matchLabels": labels.component_labels(labels.OPERATOR)}},
             *(dict(peer) for peer in config.extra_from)]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _metadata(owner),
        "spec": {"podSelector": {"matchLabels": labels.engine_selector(owner.name)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT},
                                                       *kv_cache_args.policy_ports(spec)]}]},
    }


def render(owner: Owner, spec: api.InferenceServiceSpec, network: NetworkPolicyConfig | None = None) -> list[dict]:
    """Every child of one InferenceService, in apply order (a NetworkPolicy when `network` is given)."""
    if spec.engine.multi_node:
        # A group's pods talk to each other (NetworkPolicy first, so that they can once they start).
        group = [leaderworkerset.group_network_policy(_metadata(owner), owner.name)] if network is not None else []
        workload = [*group, leaderworkerset.manifest(_metadata(owner), owner.name, spec)]
    else:
        workload = [deployment(owner, spec)]
    children = [*workload, service(owner, spec), pod_disruption_budget(owner, spec)]
    children += [network_policy(owner, network, spec)] if network is not None else []
    # spec.prefill: the prefill pool (docs/disaggregation.md), after the decode pods that connect to it
    children += prefill_pool.render(owner.name, owner.namespace, owner_reference(owner), spec, network)
    # spec.model.cache.node: the model fetched to every node's cache before a pod needs it (node_prefetch.py)
    return children + node_prefetch.render(owner.name, owner.namespace, owner_reference(owner), spec)


def dist_key_secret(owner: Owner, key: str) -> dict:
    """A multi-node service's control-channel key `key` as its Secret (made once: Kube.create_once)."""
    return leaderworkerset.dist_key_secret(_metadata(owner), owner.name, key)


def admin_key_secret(owner: Owner, key: str) -> dict:
    """A service with adapters: the engine's admin key `key` as its Secret (made once: Kube.create_once)."""
    return adapter_pods.admin_key_secret(_metadata(owner), owner.name, key)


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{SERVICE_PORT}"

