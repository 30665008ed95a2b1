"""Pure: spec.prefill → the prefill pool's children (Deployment, Service, NetworkPolicy), and the flags that
point the decode pods (the engine pods of the rest of the spec) at them. docs/disaggregation.md.

The prefill pods are the engine pod (pod_template.py) of the same model and engine settings, with
`--role prefill`, the pool's own replicas and resources, and the component label `prefill`, so neither the
router, the autoscaler nor the engine Service pick them. Only the decode pods of the same InferenceService
(and the operator, which scrapes /metrics) may connect to them.
"""
from __future__ import annotations

from kaon_operator import api, labels
from kaon_operator.children import pod_template
from kaon_operator.children.disagg_args import SERVICE_PORT, name_of
from kaon_operator.children.pod_template import HTTP_PORT
from kaon_operator.config import NetworkPolicyConfig


def selector(name: str) -> dict[str, str]:
    return {labels.SERVICE: name, labels.COMPONENT: labels.PREFILL}


def _pool_spec(spec: api.InferenceServiceSpec) -> api.InferenceServiceSpec:
    """The spec a prefill pod is rendered from: the pool's replicas and resources and no pool of its own. It keeps
    spec.adapters: the adapter loop loads them on the prefill pods as on the decode pods (and gates their
    readiness on it), so a LoRA prompt's K/V is computed with its adapter here."""
    assert spec.prefill is not None
    return spec.model_copy(update={"prefill": None, "replicas": spec.prefill.replicas,
                                   "resources": spec.prefill.resources or spec.resources})


def _metadata(name: str, namespace: str, owner_reference: dict) -> dict:
    return {"name": name_of(name), "namespace": namespace, "labels": labels.service_labels(name, labels.PREFILL),
            "ownerReferences": [owner_reference]}


def deployment(name: str, namespace: str, owner_reference: dict, spec: api.InferenceServiceSpec) -> dict:
    pool = _pool_spec(spec)
    pod = pod_template.pod_spec(name, pool)
    pod["containers"][0]["args"] = [*pod["containers"][0]["args"], "--role", "prefill"]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(name, namespace, owner_reference),
        "spec": {
            "replicas": pool.replicas,
            "selector": {"matchLabels": selector(name)},
            "strategy": {"type": "RollingUpdate", "rollingUpdate": dict(api.ROLLING_UPDATES[spec.rollout.strategy])},
            "progressDeadlineSeconds": pod_template.progress_deadline_seconds(pool),
            "template": {"metadata": {"labels": labels.service_labels(name, labels.PREFILL)}, "spec": pod},
        },
    }


def service(name: str, namespace: str, owner_reference: dict) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(name, namespace, owner_reference),
        "spec": {"type": "ClusterIP", "selector": selector(name),
                 "ports": [{"name": "http", "port": SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}]},
    }


def network_policy(name: str, namespace: str, owner_reference: dict, config: NetworkPolicyConfig) -> dict:
    """Prefill pods take connections from this InferenceService's decode pods, and from the operator (metrics)."""
    release = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": config.release_namespace}}}
    peers = [{"podSelector": {"matchLabels": labels.engine_selector(name)}},
             {**release, "podSelector": {"matchLabels": labels.component_labels(labels.OPERATOR)}}]
    return {
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": _metadata(name, namespace, owner_reference),
        "spec": {"podSelector": {"matchLabels": selector(name)}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": peers, "ports": [{"protocol": "TCP", "port": HTTP_PORT}]}]},
    }


def render(name: str, namespace: str, owner_reference: dict, spec: api.InferenceServiceSpec,
           network: NetworkPolicyConfig | None) -> list[dict]:
    """The prefill pool's children, in apply order; none without spec.prefill."""
    if spec.prefill is None:
        return []
    policy = [network_policy(name, namespace, owner_reference, network)] if network is not None else []
    return [*policy, deployment(name, namespace, owner_reference, spec), service(name, namespace, owner_reference)]


# The kinds render() may return: what is deleted when spec.prefill goes away.
KINDS = (("apps/v1", "Deployment"), ("v1", "Service"), ("networking.k8s.io/v1", "NetworkPolicy"))
