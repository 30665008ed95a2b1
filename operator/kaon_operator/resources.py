"""Pure functions from an InferenceService to the manifests of its children.

No I/O: the handlers server-side apply what `render()` returns. Every child carries the
labels in ARCHITECTURE.md and an owner reference, so deleting the InferenceService
garbage-collects it.
"""
from __future__ import annotations

from dataclasses import dataclass

from kaon_operator import api

HTTP_PORT = 8000
SERVICE_PORT = 80
# `kaon serve --drain-timeout`: in-flight requests get this long after SIGTERM. The kubelet
# must not SIGKILL before the drain and uvicorn's shutdown are over, hence the margin.
DRAIN_SECONDS = 30
TERMINATION_GRACE_SECONDS = DRAIN_SECONDS + 15
# Loading (and quantizing) a large model can take many minutes; liveness waits for it.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180  # 30 minutes
SHM_GIB_PER_GPU = 2  # tensor-parallel workers exchange tensors through /dev/shm
CACHE_DIR = "/var/cache/kaon"  # Triton and Hugging Face caches, model downloads
RUN_AS = 1000


@dataclass(frozen=True, slots=True)
class Owner:
    """The InferenceService that owns the children."""

    name: str
    namespace: str
    uid: str


def labels(name: str, component: str = "engine") -> dict[str, str]:
    return {"app.kubernetes.io/name": "kaon", "app.kubernetes.io/instance": name,
            "app.kubernetes.io/component": component, "kaon.dev/inferenceservice": name}


def selector_labels(name: str) -> dict[str, str]:
    """Engine pods of one InferenceService (a Deployment's selector is immutable: keep it small)."""
    return {"kaon.dev/inferenceservice": name, "app.kubernetes.io/component": "engine"}


def selector(name: str) -> str:
    """The same selector as a string, for status.selector (scale subresource)."""
    return ",".join(f"{k}={v}" for k, v in selector_labels(name).items())


def owner_reference(owner: Owner) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "name": owner.name, "uid": owner.uid,
            "controller": True, "blockOwnerDeletion": True}


def _metadata(owner: Owner, component: str = "engine") -> dict:
    return {"name": owner.name, "namespace": owner.namespace, "labels": labels(owner.name, component),
            "ownerReferences": [owner_reference(owner)]}


def engine_args(owner: Owner, spec: api.InferenceServiceSpec) -> list[str]:
    """The `kaon serve` command line."""
    model, engine = spec.model, spec.engine
    args = ["kaon", "serve", "--model", model.uri, "--served-model-name", model.served_name or owner.name,
            "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--drain-timeout", str(DRAIN_SECONDS),
            "--tensor-parallel-size", str(engine.tensor_parallel_size),
            "--max-num-seqs", str(engine.max_num_seqs),
            "--max-num-batched-tokens", str(engine.max_num_batched_tokens),
            "--kv-cache-fraction", str(engine.kv_cache_fraction)]
    if model.quantization != "none":
        args += ["--quantization", model.quantization]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    return args + list(engine.extra_args)


def _resources(spec: api.InferenceServiceSpec) -> dict:
    gpus = str(spec.engine.tensor_parallel_size)
    given = spec.resources or api.ResourcesSpec()
    # Extended resources must have requests == limits; the CRD refuses a GPU count in spec.resources.
    return {"requests": {**{k: str(v) for k, v in (given.requests or {}).items()}, api.GPU_RESOURCE: gpus},
            "limits": {**{k: str(v) for k, v in (given.limits or {}).items()}, api.GPU_RESOURCE: gpus}}


def _probe(path: str, *, period: int, failures: int, timeout: int = 5) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


def _volumes(spec: api.InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    volumes = [{"name": "cache", "emptyDir": {}}, {"name": "tmp", "emptyDir": {}}]
    mounts = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": "/tmp"}]
    tp = spec.engine.tensor_parallel_size
    if tp > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{tp * SHM_GIB_PER_GPU}Gi"}})
        mounts.append({"name": "dshm", "mountPath": "/dev/shm"})
    return volumes, mounts


def _container(owner: Owner, spec: api.InferenceServiceSpec, mounts: list[dict]) -> dict:
    return {
        "name": "engine",
        "image": spec.engine.image,
        "args": engine_args(owner, spec),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"}],
        "env": [{"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
                {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
                {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
                {"name": "HOME", "value": "/tmp"}],
        "resources": _resources(spec),
        # /health answers once the model is loaded; until then only the startup probe runs.
        "startupProbe": _probe("/health", period=STARTUP_PERIOD_SECONDS, failures=STARTUP_FAILURE_THRESHOLD),
        "livenessProbe": _probe("/health", period=10, failures=3),
        "readinessProbe": _probe("/ready", period=5, failures=2),
        "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                            "capabilities": {"drop": ["ALL"]}},
    }


def _tolerations(spec: api.InferenceServiceSpec) -> list[dict]:
    # GPU nodes are commonly tainted so that only GPU pods land there.
    gpu = {"key": api.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    given = (spec.scheduling.tolerations if spec.scheduling else None) or []
    return [gpu, *(t for t in given if t != gpu)]


def _pod_spec(owner: Owner, spec: api.InferenceServiceSpec) -> dict:
    volumes, mounts = _volumes(spec)
    pod = {
        "containers": [_container(owner, spec, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": TERMINATION_GRACE_SECONDS,
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,  # the engine never talks to the apiserver
        "enableServiceLinks": False,
        "tolerations": _tolerations(spec),
    }
    scheduling = spec.scheduling or api.SchedulingSpec()
    if scheduling.node_selector:
        pod["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.affinity:
        pod["affinity"] = scheduling.affinity
    return pod


def deployment(owner: Owner, spec: api.InferenceServiceSpec) -> dict:
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": _metadata(owner),
        "spec": {
            "replicas": spec.replicas,
            "selector": {"matchLabels": selector_labels(owner.name)},
            # One new pod at a time and none taken down before it is ready: GPUs are scarce,
            # and capacity must not dip during a rollout.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels(owner.name)}, "spec": _pod_spec(owner, spec)},
        },
    }


def service(owner: Owner) -> dict:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": _metadata(owner),
        "spec": {"type": "ClusterIP", "selector": selector_labels(owner.name),
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
        "spec": {"minAvailable": min_available(spec), "selector": {"matchLabels": selector_labels(owner.name)}},
    }


def render(owner: Owner, spec: api.InferenceServiceSpec) -> list[dict]:
    """Every child of one InferenceService, in apply order."""
    return [deployment(owner, spec), service(owner), pod_disruption_budget(owner, spec)]


def service_url(owner: Owner) -> str:
    return f"http://{owner.name}.{owner.namespace}.svc:{SERVICE_PORT}"
