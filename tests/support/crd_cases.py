"""InferenceService specs the CRD tests share: a minimal one, refusals with the apiserver's message, valid model
sources."""
from __future__ import annotations

import copy

from kaon_operator import api

MINIMAL = {"model": {"uri": "builtin://smollm2-135m-instruct"}}


def manifest(name: str, spec: dict) -> dict:
    return {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": name}, "spec": spec}


def with_(path: str, value, base: dict = MINIMAL) -> dict:
    """A copy of `base` with the dotted `path` set to `value` (None deletes it)."""
    spec = copy.deepcopy(base)
    *parents, leaf = path.split(".")
    node = spec
    for key in parents:
        node = node.setdefault(key, {})
    if value is None:
        node.pop(leaf, None)
    else:
        node[leaf] = value
    return spec


INVALID = [
    ("min-gt-max", with_("autoscaling", {"minReplicas": 5, "maxReplicas": 2}), "minReplicas must be <= maxReplicas"),
    ("tp-128", with_("engine.tensorParallelSize", 128), "should be less than or equal to 64"),
    ("quant-int3", with_("model.quantization", "int3"), 'Unsupported value: "int3"'),
    ("negative-replicas", with_("replicas", -1), "should be greater than or equal to 0"),
    ("cache-node-and-pvc", with_("model.cache", {"node": True, "persistentVolumeClaim": "models"}),
     "node and persistentVolumeClaim are two places for the cache: name one"),
    ("standby-17", with_("autoscaling.standby", 17), "should be less than or equal to 16"),
    ("missing-model", {"replicas": 1}, "spec.model: Required value"),
    ("relative-uri", with_("model.uri", "models/x.gguf"),
     "must be hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>, pvc://<claim>/<path>, builtin://<name> or "
     "an absolute path"),
    ("gs-uri", with_("model.uri", "gs://bucket/llama"), "must be hf://<org>/<name>[@<revision>], s3://"),
    ("hf-without-name", with_("model.uri", "hf://meta-llama"),
     "an hf:// URI must be hf://<org>/<name> or hf://<org>/<name>@<revision>"),
    ("s3-bad-bucket", with_("model.uri", "s3://My_Bucket/llama"),
     "an s3:// URI must be s3://<bucket>/<prefix> with a valid bucket name (3-63 of a-z, 0-9, '.', '-')"),
    ("pvc-bad-claim", with_("model.uri", "pvc://Models_1/llama"),
     "a pvc:// URI must be pvc://<claim>/<path> with a valid PersistentVolumeClaim name"),
    ("pvc-dotdot", with_("model.uri", "pvc://models/../../etc"), "must not contain '..' path segments"),
    ("adapter-path-uri", with_("adapters", [{"name": "a", "uri": "/adapters/a"}]),
     "an adapter's uri must be hf://, s3:// or pvc://"),
    ("adapter-name-slash", with_("adapters", [{"name": "ns/a", "uri": "hf://org/a"}]), "should match"),
    ("adapter-twice", with_("adapters", [{"name": "a", "uri": "hf://org/a"}, {"name": "a", "uri": "hf://org/b"}]),
     "Duplicate value"),
    ("revision-on-a-path", with_("model", {"uri": "/models/x", "revision": "v1"}),
     "revision is for hf:// URIs that do not name one with @<revision>"),
    ("revision-twice", with_("model", {"uri": "hf://org/name@v1", "revision": "v2"}),
     "revision is for hf:// URIs that do not name one with @<revision>"),
    ("secret-on-pvc", with_("model", {"uri": "pvc://models/llama", "credentialsSecret": "creds"}),
     "credentialsSecret is for hf:// and s3:// sources"),
    ("endpoint-on-a-path", with_("model", {"uri": "/models/x", "endpoint": "http://minio:9000"}),
     "endpoint is for hf:// and s3:// sources"),
    ("gguf-on-builtin", with_("model.ggufFile", "x.gguf"),
     "ggufFile is for hf:// and s3:// sources (point a path or pvc:// URI at the file itself)"),
    ("inline-token", with_("model", {"uri": "hf://org/name", "token": "hf_xxx"}),
     'unknown field "spec.model.token"'),
    ("reserved-volume", with_("engine.volumes", [{"name": "cache", "emptyDir": {}}]),
     "volume names cache, tmp, dshm, model are the operator's own"),
    ("reserved-mount", with_("engine.volumeMounts", [{"name": "certs", "mountPath": "/var/cache/kaon"}]),
     "mount paths /var/cache/kaon, /tmp, /dev/shm, /mnt/models are the operator's own"),
    ("gpu-in-resources", with_("resources", {"limits": {"nvidia.com/gpu": 2}}),
     "nvidia.com/gpu comes from engine.tensorParallelSize; do not set it here"),
    ("zero-without-idle", with_("autoscaling", {"minReplicas": 0}), "minReplicas 0 needs scaleToZeroIdleSeconds"),
    ("idle-without-zero", with_("autoscaling", {"scaleToZeroIdleSeconds": 60}),
     "scaleToZeroIdleSeconds needs minReplicas 0"),
    ("predictive-without-profile", with_("autoscaling", {"policy": "predictive"}),
     "policy predictive needs profile: auto (the operator measures the engine) or the ConfigMap holding the "
     "engine's performance model"),
    ("predictive-profile-none", with_("autoscaling", {"policy": "predictive", "profile": "none"}),
     "policy predictive needs profile: auto (the operator measures the engine) or the ConfigMap holding the "
     "engine's performance model"),
    ("kv-fraction-0", with_("engine.kvCacheFraction", 0), "should be greater than 0"),
    ("latency-metric", with_("autoscaling.latencyMetric", "p50"), 'Unsupported value: "p50"'),
    ("pp-without-nodes", with_("engine.nodesPerReplica", 2),
     "pipelineParallelSize must equal nodesPerReplica: each node (pod) of a replica runs one pipeline stage on its "
     "tensorParallelSize GPUs"),
    ("nodes-0", with_("engine.nodesPerReplica", 0), "should be greater than or equal to 1"),
    ("adapters-with-embed", with_("adapters", [{"name": "sql", "uri": "hf://org/sql-lora"}],
                                  with_("engine.task", "embed")),
     "adapters need engine.task generate: an embedding runs on the base model, and a sentence encoder takes no "
     "LoRA adapters"),
    ("prefill-with-tp", with_("prefill", {}, with_("engine.tensorParallelSize", 2)),
     "prefill (disaggregation) needs engine.tensorParallelSize 1, engine.nodesPerReplica 1 and engine.task "
     "generate: each engine's K/V moves from one process"),
    ("unknown-field", with_("engine.tensorParalelSize", 2), 'unknown field "spec.engine.tensorParalelSize"'),
    ("bad-strategy", with_("routing.strategy", "kv_aware"), 'Unsupported value: "kv_aware"'),
    ("tiers-negative", with_("engine.kvOffload", {"hostBytes": -1}), "should be greater than or equal to 0"),
    ("tiers-relative-path", with_("engine.kvOffload", {"diskBytes": 1 << 30, "diskPath": "kv"}), "should match"),
    ("tiers-on-an-operator-mount", with_("engine.kvOffload", {"diskBytes": 1 << 30, "diskPath": "/dev/shm"}),
     "kvOffload.diskPath may not be /var/cache/kaon, /tmp, /dev/shm or /mnt/models: the operator mounts its own "
     "volumes there (use a path of its own, such as /var/cache/kaon-kv)"),
    ("tiers-without-prefix-caching", with_("engine", {"kvOffload": {"hostBytes": 1 << 30},
                                                       "enablePrefixCaching": False}),
     "kvOffload needs enablePrefixCaching true, tensorParallelSize 1 and pipelineParallelSize 1: the tiers keep one "
     "process's cached prefixes"),
    ("tiers-with-tp", with_("engine", {"kvOffload": {"diskBytes": 1 << 30}, "tensorParallelSize": 2}),
     "kvOffload needs enablePrefixCaching true, tensorParallelSize 1 and pipelineParallelSize 1: the tiers keep one "
     "process's cached prefixes"),
    # A malformed or negative quantity: refused at apply, naming the field, not at each pod the operator renders.
    ("quantity-typo", with_("resources", {"requests": {"memory": "16GB"}}),
     "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"),
    ("quantity-word", with_("resources", {"limits": {"cpu": "lots"}}),
     "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"),
    ("quantity-negative", with_("resources", {"requests": {"cpu": -1}}),
     "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"),
    ("size-limit-negative", with_("model.cache", {"sizeLimit": "-5Gi"}),
     "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"),
    ("size-limit-space", with_("model.cache", {"sizeLimit": "100 Gi"}),
     "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"),
]

# Quantities both pydantic and the apiserver accept (Kubernetes' grammar: decimal, binary and exponent suffixes).
VALID_QUANTITIES = [4, "4", "500m", "16Gi", "1.5Gi", "1e9", "2E3", "+1", ".5", "0", 0, "128M", "1Ti"]


VALID_SOURCES = ["hf://meta-llama/Llama-3.1-8B-Instruct", "hf://Qwen/Qwen2.5-0.5B@refs/pr/1", "s3://models/llama/3.1-8b",
                 "s3://my.bucket", "pvc://models/llama-3.1-8b", "pvc://models", "builtin://smollm2-135m-instruct",
                 "/models/llama.gguf"]
