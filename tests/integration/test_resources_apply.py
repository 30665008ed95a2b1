"""Rendered children applied to a real kube-apiserver: accepted in every variant, scheduled on fake GPU nodes,
garbage collected."""
from __future__ import annotations

import ipaddress
import json

from kaon_operator import api, labels
from kaon_operator.children import resources as r

VARIANTS = [
    {},
    {"model": {"uri": "hf://org/name@v1", "credentialsSecret": "hf", "cache": {"persistentVolumeClaim": "cache"}},
     "engine": {"tensorParallelSize": 3, "env": [{"name": "A", "value": "1"}],
                "envFrom": [{"secretRef": {"name": "e"}}],
                "volumes": [{"name": "certs", "secret": {"secretName": "ca"}}],
                "volumeMounts": [{"name": "certs", "mountPath": "/etc/ssl/extra"}],
                "imagePullSecrets": [{"name": "registry"}]}},
    {"model": {"uri": "s3://models/llama", "credentialsSecret": "s3", "endpoint": "http://minio:9000"}},
    {"model": {"uri": "pvc://models/llama"}},
    {"engine": {"tensorParallelSize": 8, "enablePrefixCaching": False, "extraArgs": ["--log-level", "debug"]},
     "model": {"uri": "/models/llama", "quantization": "fp8", "maxModelLen": 8192, "servedName": "llama"},
     "resources": {"requests": {"cpu": "500m", "memory": "16Gi"}, "limits": {"memory": "16Gi"}},
     "scheduling": {"nodeSelector": {"gpu": "h100"},
                    "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
                    "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
                        {"weight": 50, "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": labels.service_labels("llama")}}}]}}},
     "replicas": 4, "rollout": {"strategy": "Replace"}, "drainSeconds": 600,
     "autoscaling": {"enabled": True, "minReplicas": 0, "maxReplicas": 8, "scaleToZeroIdleSeconds": 300}},
]


NETWORK = r.NetworkPolicyConfig("kaon-system", extra_from=(
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
     "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}},))


def create_isvc(cp, namespace: str, name: str, spec_dict: dict) -> r.Owner:
    body = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name, "namespace": namespace},
            "spec": {"model": {"uri": "builtin://smollm2-135m-instruct"}, **spec_dict}}
    obj = json.loads(cp.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(body)).stdout)
    return r.Owner(name=name, namespace=namespace, uid=obj["metadata"]["uid"])


def apply(cp, manifests: list[dict], *extra: str) -> None:
    cp.kubectl("apply", "--server-side", "--field-manager=kaon-operator", *extra, "-f", "-",
               input=json.dumps({"apiVersion": "v1", "kind": "List", "items": manifests}))


def test_rendered_manifests_are_accepted_by_the_apiserver(crd, namespace):
    for i, variant in enumerate(VARIANTS):
        owner = create_isvc(crd, namespace, f"v{i}", variant)
        s = api.InferenceServiceSpec.model_validate(
            crd.kubectl_json("get", "-n", namespace, "infsvc", owner.name)["spec"])
        apply(crd, r.render(owner, s, NETWORK), "--dry-run=server")


def test_applied_children_run_on_fake_gpu_nodes_and_are_garbage_collected(crd, namespace):
    # A kwok-ready/* image: KWOK marks these engine pods Ready (the default image never is, as
    # nothing here can run it).
    owner = create_isvc(crd, namespace, "llama", {"engine": {"tensorParallelSize": 4, "image": "kwok-ready/kaon:1"},
                                                  "replicas": 2})
    s = api.InferenceServiceSpec.model_validate(crd.kubectl_json("get", "-n", namespace, "infsvc", "llama")["spec"])
    apply(crd, r.render(owner, s, NETWORK))
    apply(crd, r.render(owner, s, NETWORK))  # idempotent: a second apply by the same manager changes nothing
    crd.kubectl("rollout", "status", "-n", namespace, "deployment/llama", "--timeout=60s")

    pods = crd.kubectl_json("get", "pods", "-n", namespace, "-l", r.selector("llama"))["items"]
    assert len(pods) == 2
    for pod in pods:
        assert pod["status"]["phase"] == "Running" and ipaddress.ip_address(pod["status"]["podIP"]) in crd.pod_network
        assert pod["spec"]["nodeName"].startswith("gpu-node-")

    crd.kubectl("delete", "-n", namespace, "infsvc", "llama")
    for kind in ("deployment", "service", "poddisruptionbudget", "networkpolicy"):
        crd.kubectl("wait", "-n", namespace, "--for=delete", f"{kind}/llama", "--timeout=60s")
