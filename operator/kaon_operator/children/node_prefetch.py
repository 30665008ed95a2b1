"""Pure: spec.model.cache.node -> a DaemonSet `<name>-prefetch` that fetches the model into the node cache
of every node the engine pods may land on, when the InferenceService is created or its model changes, so
that a scale-up (or a restart) on any of them finds the files there and skips the download.

Why a DaemonSet, and not per-node Jobs or only the engine pod's own init step: it is what a cluster admin
already knows from image pre-pullers and node agents (`kubectl get ds` shows DESIRED / READY per node);
the scheduler places it by the engine pods' own nodeSelector, node affinity and tolerations, so it
covers exactly the nodes they may use, including nodes added later by a node autoscaler (per-node Jobs
would need the operator to watch Nodes and re-derive scheduling); a model change rolls it like any
DaemonSet, node by node, and deleting the InferenceService (or turning cache.node off) removes it.
Its cost: one idle container per node (a few MiB, no GPU); its pod is the engine pod's own `kaon fetch`
init container, same arguments, credentials and cache mount (so the same folder, namespace by
namespace), followed by a container that only waits.

Only hf:// and s3:// models are fetched; builtin:// ships in the image and pvc:// is a claim already.
"""
from __future__ import annotations

from kaon_operator import api, labels
from kaon_operator.children import pod_template

API_VERSION, KIND = "apps/v1", "DaemonSet"
PREFETCH = "model-prefetch"  # the component label: no router, autoscaler or Service selects these pods
HOLD_CONTAINER = "hold"
# The engine image has Python (kaon is a Python program): waiting needs no other image to mirror.
HOLD_COMMAND = ["python3", "-c", "import signal; signal.pause()"]
HOLD_RESOURCES = {"requests": {"cpu": "10m", "memory": "32Mi"}, "limits": {"memory": "64Mi"}}
FETCHED_SCHEMES = ("hf://", "s3://")


def name_of(name: str) -> str:
    return f"{name}-prefetch"


def needed(spec: api.InferenceServiceSpec) -> bool:
    return spec.model.cache.node and spec.model.uri.startswith(FETCHED_SCHEMES)


def dropped(spec: api.InferenceServiceSpec, previous: api.InferenceServiceSpec | str | None) -> bool:
    """Whether a spec change leaves a prefetch DaemonSet behind (the node cache switched off, or the model no
    longer fetched): the reconciler deletes it. The files stay on the nodes, as an engine pod's would."""
    return isinstance(previous, api.InferenceServiceSpec) and needed(previous) and not needed(spec)


def selector(name: str) -> dict[str, str]:
    return {labels.SERVICE: name, labels.COMPONENT: PREFETCH}


def _node_scheduling(engine_pod: dict) -> dict:
    """Where the engine pods may run: nodeSelector, tolerations, and node affinity only (pod affinity is
    about engine pods, not about a node's disk)."""
    out = {k: engine_pod[k] for k in ("nodeSelector", "tolerations", "imagePullSecrets") if k in engine_pod}
    node_affinity = (engine_pod.get("affinity") or {}).get("nodeAffinity")
    if node_affinity:
        out["affinity"] = {"nodeAffinity": node_affinity}
    return out


def pod_spec(name: str, spec: api.InferenceServiceSpec) -> dict:
    engine_pod = pod_template.pod_spec(name, spec)
    [fetch] = engine_pod["initContainers"]
    mounted = {m["name"] for m in fetch["volumeMounts"]}
    hold = {"name": HOLD_CONTAINER, "image": spec.engine.image, "command": HOLD_COMMAND,
            "resources": HOLD_RESOURCES, "securityContext": fetch["securityContext"]}
    return {
        "initContainers": [fetch],
        "containers": [hold],
        "volumes": [v for v in engine_pod["volumes"] if v["name"] in mounted],
        "securityContext": engine_pod["securityContext"],
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 5,
        **_node_scheduling(engine_pod),
    }


def render(name: str, namespace: str, owner_reference: dict, spec: api.InferenceServiceSpec) -> list[dict]:
    """The prefetch DaemonSet when the spec asks for the node cache of a fetched model, else nothing."""
    if not needed(spec):
        return []
    pod_labels = labels.service_labels(name, PREFETCH)
    return [{
        "apiVersion": API_VERSION, "kind": KIND,
        "metadata": {"name": name_of(name), "namespace": namespace, "labels": pod_labels,
                     "ownerReferences": [owner_reference]},
        "spec": {
            "selector": {"matchLabels": selector(name)},
            # One node at a time by default: a model change re-fetches node by node, never all at once.
            "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": 1}},
            "template": {"metadata": {"labels": pod_labels}, "spec": pod_spec(name, spec)},
        },
    }]
