"""The InferenceService API (kaon.dev/v1alpha1): pydantic models of its spec (the status: api_status.py).

The CRD in crds/ is generated from these models (`python -m kaon_operator.crd`), and a
test proves the two agree. Every rule here is also a CEL rule in the CRD (the
`x-kubernetes-validations` entries), so the apiserver refuses what these models refuse.
Field names are snake_case in Python and camelCase on the wire.

Over 300 lines for a stated reason: one model per object of the spec, each field with the
docstring that becomes its CRD description, and each CEL rule beside the pydantic check
that mirrors it; split further, a rule would live apart from its twin.
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic.alias_generators import to_camel

GROUP = "kaon.dev"
VERSION = "v1alpha1"
KIND = "InferenceService"
PLURAL = "inferenceservices"
API_VERSION = f"{GROUP}/{VERSION}"

DEFAULT_IMAGE = "ghcr.io/kaon-dev/kaon:0.1.0"
GPU_RESOURCE = "nvidia.com/gpu"
# The engine's own --max-num-seqs default on a GPU (engine/admission.py: 8 on a CPU). With engine.maxNumSeqs
# unset the operator passes no flag, so each engine resolves its device's default; the router's slot rule and the
# autoscaler's target, which need a number before any pod runs, count this one (a GPU pod's) unless a profile
# measured the engine's own.
ENGINE_GPU_MAX_NUM_SEQS = 64

# A Kubernetes resource quantity: 2, "500m", "16Gi". Checked here and by the apiserver (CEL's quantity
# library), so a typo such as "16GB " or "lots" is refused at `kubectl apply` with the field's path, rather
# than accepted and then failing at each pod the operator renders from it (or at the emptyDir's sizeLimit).
# The grammar is Kubernetes' own (resource.Quantity), negative values left out: no request, limit or size
# may be below zero.
_QUANTITY_RE = r"^[+]?([0-9]+[.]?[0-9]*|[.][0-9]+)([KMGTPE]i|[mkMGTPE]|[eE][+-]?[0-9]+)?$"
_QUANTITY_MESSAGE = "must be a non-negative Kubernetes quantity, such as 4, 500m, 16Gi or 1e9"
_QUANTITY_CEL = "type(self) == int ? self >= 0 : (isQuantity(self) && !self.startsWith('-'))"


def _check_quantity(value: int | str) -> int | str:
    if isinstance(value, int):
        ok = value >= 0
    else:
        ok = len(value) <= _QUANTITY_MAX_LENGTH and re.match(_QUANTITY_RE, value) is not None
    if not ok:
        raise ValueError(f"{value!r} {_QUANTITY_MESSAGE}")
    return value


# The bounds (a quantity's length, resources per map) keep the CEL rule's estimated cost within the apiserver's
# budget; without them it refuses the CRD itself.
_QUANTITY_MAX_LENGTH = 64
_MAX_RESOURCES = 32
Quantity = Annotated[int | str, AfterValidator(_check_quantity),
                     Field(json_schema_extra={"maxLength": _QUANTITY_MAX_LENGTH, "x-kubernetes-validations": [
                         {"rule": _QUANTITY_CEL, "message": _QUANTITY_MESSAGE}]})]


class Key(NamedTuple):
    """An InferenceService's namespace and name: how the operator's caches and records and the
    router's table name it."""

    namespace: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def _cel(rule: str, message: str) -> dict:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class _Model(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              use_attribute_docstrings=True)


def _default(model: type[_Model]) -> dict:
    """The CRD default of an optional object: written out in full, because the apiserver
    checks a default against the object's CEL rules before its fields' defaults apply."""
    return {"default": model().model_dump(by_alias=True, exclude_none=True)}


# Model sources. Each rule is a CEL rule on the field (x-kubernetes-validations) and the same
# check in pydantic below; `_URI_RULES` holds both spellings side by side.
_HF_RE = r"^hf://[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*(@[^@ ]+)?$"
_S3_RE = r"^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/[^ ]*)?$"
_PVC_RE = r"^pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/[^ ]*)?$"
_URI_MESSAGE = ("must be hf://<org>/<name>[@<revision>], s3://<bucket>/<prefix>, pvc://<claim>/<path>, "
                "builtin://<name> or an absolute path")
_URI_RULES = [  # (CEL rule, Python check, message)
    ("self.startsWith('builtin://') || self.startsWith('/') || self.startsWith('hf://') || self.startsWith('s3://')"
     " || self.startsWith('pvc://')",
     lambda v: v.startswith(("builtin://", "/", "hf://", "s3://", "pvc://")), _URI_MESSAGE),
    (f"!self.startsWith('hf://') || self.matches('{_HF_RE}')",
     lambda v: not v.startswith("hf://") or re.match(_HF_RE, v) is not None,
     "an hf:// URI must be hf://<org>/<name> or hf://<org>/<name>@<revision>"),
    (f"!self.startsWith('s3://') || self.matches('{_S3_RE}')",
     lambda v: not v.startswith("s3://") or re.match(_S3_RE, v) is not None,
     "an s3:// URI must be s3://<bucket>/<prefix> with a valid bucket name (3-63 of a-z, 0-9, '.', '-')"),
    (f"!self.startsWith('pvc://') || self.matches('{_PVC_RE}')",
     lambda v: not v.startswith("pvc://") or re.match(_PVC_RE, v) is not None,
     "a pvc:// URI must be pvc://<claim>/<path> with a valid PersistentVolumeClaim name"),
    ("!self.contains('/../') && !self.endsWith('/..')",
     lambda v: "/../" not in v and not v.endswith("/.."), "must not contain '..' path segments"),
]
_REMOTE = "self.uri.startsWith('hf://') || self.uri.startsWith('s3://')"
_MODEL_RULES = [  # (CEL rule, Python check on the ModelSpec, message)
    ("!has(self.revision) || (self.uri.startsWith('hf://') && !self.uri.contains('@'))",
     lambda m: m.revision is None or (m.uri.startswith("hf://") and "@" not in m.uri),
     "revision is for hf:// URIs that do not name one with @<revision>"),
    (f"!has(self.credentialsSecret) || {_REMOTE}",
     lambda m: m.credentials_secret is None or m.uri.startswith(("hf://", "s3://")),
     "credentialsSecret is for hf:// and s3:// sources"),
    (f"!has(self.endpoint) || {_REMOTE}",
     lambda m: m.endpoint is None or m.uri.startswith(("hf://", "s3://")), "endpoint is for hf:// and s3:// sources"),
    (f"!has(self.ggufFile) || {_REMOTE}",
     lambda m: m.gguf_file is None or m.uri.startswith(("hf://", "s3://")),
     "ggufFile is for hf:// and s3:// sources (point a path or pvc:// URI at the file itself)"),
]
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"


_NODE_OR_PVC = "!(has(self.node) && self.node && has(self.persistentVolumeClaim))"
_NODE_OR_PVC_MESSAGE = "node and persistentVolumeClaim are two places for the cache: name one"


class ModelCacheSpec(_Model):
    """Where fetched models (hf://, s3://) are kept: a per-pod emptyDir, a shared PersistentVolumeClaim, or the node."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _NODE_OR_PVC, "message": _NODE_OR_PVC_MESSAGE}]})

    persistent_volume_claim: str | None = Field(None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    """An existing ReadWriteMany PVC that every replica mounts: the first one downloads, the others reuse it."""
    size_limit: Quantity = "100Gi"
    """Size limit of the per-pod emptyDir used when no PVC is named; with `cache.node`, the bound of the namespace's node folder (least recently used models no pod uses are removed past it)."""  # noqa: E501 - one line: the CRD's description
    node: bool = False
    """Keep the fetched files on the node (a hostPath, /var/lib/kaon/cache/<namespace>), so a later pod on a node that has the model (a scale-up, a restart) skips the download. Needs the admin's operator.allowHostPath."""  # noqa: E501 - one line: the CRD's description

    @model_validator(mode="after")
    def _one_place(self) -> ModelCacheSpec:
        if self.node and self.persistent_volume_claim:
            raise ValueError(_NODE_OR_PVC_MESSAGE)
        return self


class ModelSpec(_Model):
    """Which model to serve and how."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": rule, "message": message} for rule, _, message in _MODEL_RULES]})

    uri: str = Field(min_length=1, max_length=4096, json_schema_extra={"x-kubernetes-validations": [
        {"rule": rule, "message": message} for rule, _, message in _URI_RULES]})
    """`hf://<org>/<name>[@<revision>]`, `s3://<bucket>/<prefix>`, `pvc://<claim>/<path>`,
    `builtin://smollm2-135m-instruct`, or an absolute path (GGUF file or HF directory) in the image."""
    revision: str | None = Field(None, min_length=1, max_length=255)
    """hf:// only: the branch, tag or commit (default `main`); the same as `hf://<org>/<name>@<revision>`."""
    gguf_file: str | None = Field(None, min_length=6, max_length=1024, pattern=r"^[^/].*\.gguf$")
    """hf:// and s3://: fetch this GGUF file of the repository instead of its safetensors."""
    credentials_secret: str | None = Field(None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    """A Secret in the same namespace: `HF_TOKEN` for hf://; `AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`
    and optionally `AWS_REGION`, `AWS_ENDPOINT_URL` for s3://. Read by the fetch init container only."""
    endpoint: str | None = Field(None, max_length=2048, pattern=r"^https?://[^ ]+$")
    """The S3-compatible store's URL for s3:// (MinIO, Ceph, R2...), or a hub mirror's URL for hf://."""
    cache: ModelCacheSpec = Field(default_factory=ModelCacheSpec, json_schema_extra=_default(ModelCacheSpec))
    """Where hf:// and s3:// models are downloaded to."""
    served_name: str | None = Field(None, min_length=1, max_length=253)
    """The name clients send as `model` (default: the InferenceService's name)."""
    quantization: Literal["none", "int8", "int4", "fp8"] = "none"
    """Weight quantization applied at load time."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion in tokens (default: the model's own context length)."""

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        for _, check, message in _URI_RULES:
            if not check(v):
                raise ValueError(message)
        return v

    @model_validator(mode="after")
    def _consistent(self) -> ModelSpec:
        for _, check, message in _MODEL_RULES:
            if not check(self):
                raise ValueError(message)
        return self



def served_name(model: ModelSpec | Mapping[str, Any] | None, name: str) -> str:
    """The name clients send as `model`: spec.model.servedName, else the InferenceService's `name`.
    `model` as parsed, or as on the wire (the served-name index reads bodies whether valid or not)."""
    given = model.get("servedName") if isinstance(model, Mapping) else getattr(model, "served_name", None)
    return given or name

# Name -> mount path of the operator's own volumes in the engine pod (pod_template.py mounts them;
# the spec may not take them).
OWN_VOLUMES = {"cache": "/var/cache/kaon", "tmp": "/tmp", "dshm": "/dev/shm", "model": "/mnt/models"}
RESERVED_VOLUMES = tuple(OWN_VOLUMES)
RESERVED_MOUNT_PATHS = tuple(OWN_VOLUMES.values())
_RESERVED_VOLUME_MESSAGE = f"volume names {', '.join(RESERVED_VOLUMES)} are the operator's own"
_RESERVED_PATH_MESSAGE = f"mount paths {', '.join(RESERVED_MOUNT_PATHS)} are the operator's own"
_ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"


class EnvVar(_Model):
    """An environment variable of the engine containers (a Kubernetes `EnvVar`)."""

    name: str = Field(min_length=1, max_length=1024, pattern=_ENV_NAME)
    """The variable's name."""
    value: str | None = None
    """Its value (or valueFrom)."""
    value_from: dict[str, Any] | None = None
    """`secretKeyRef`, `configMapKeyRef`, `fieldRef` or `resourceFieldRef`, as in a pod spec."""


class LocalObjectReference(_Model):
    """An object of the same namespace, by name."""

    name: str = Field(min_length=1, max_length=253)
    """The object's name (here: a Secret of type kubernetes.io/dockerconfigjson)."""


class Volume(_Model):
    """A pod volume (a Kubernetes `Volume`: a name plus one source such as `secret` or `persistentVolumeClaim`)."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"x-kubernetes-preserve-unknown-fields": True})

    name: str = Field(min_length=1, max_length=63, pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
    """The volume's name, for volumeMounts (not one of the operator's own)."""


class VolumeMount(_Model):
    """Where a volume appears in the engine containers."""

    name: str = Field(min_length=1, max_length=63)
    """The volume's name (in engine.volumes)."""
    mount_path: str = Field(min_length=2, max_length=4096, pattern=r"^/")
    """An absolute path in the containers (not one of the operator's own)."""
    read_only: bool | None = None
    """Mount it read-only."""
    sub_path: str | None = None
    """Mount this path inside the volume instead of its root."""


# Each node (pod) of a multi-node replica holds one pipeline stage on its own GPUs (the engine's contract:
# docs/multinode.md); several stages per pod, or a pipeline inside one pod, is not offered by the CRD.
_ONE_STAGE_PER_NODE_RULE = "self.pipelineParallelSize == self.nodesPerReplica"
_ONE_STAGE_PER_NODE_MESSAGE = ("pipelineParallelSize must equal nodesPerReplica: each node (pod) of a replica runs "
                               "one pipeline stage on its tensorParallelSize GPUs")


# The engine refuses tiers it cannot keep (engine/kv_observer.check_tier_config): refused here too, at admission,
# instead of pods that fail at start over and over.
_TIERS_RULE = ("!has(self.kvOffload) || (self.kvOffload.hostBytes == 0 && self.kvOffload.diskBytes == 0) || "
               "(self.enablePrefixCaching && self.tensorParallelSize == 1 && self.pipelineParallelSize == 1)")
_TIERS_MESSAGE = ("kvOffload needs enablePrefixCaching true, tensorParallelSize 1 and pipelineParallelSize 1: the "
                  "tiers keep one process's cached prefixes")


# The disk tier's emptyDir is mounted at diskPath beside the operator's own volumes: a second mount at one of their
# paths made the Deployment invalid ("must be unique"), found only when the operator applied it.
_TIERS_PATH_RULE = f"self.diskBytes == 0 || !(self.diskPath in {list(RESERVED_MOUNT_PATHS)})"
_TIERS_PATH_MESSAGE = (f"kvOffload.diskPath may not be {', '.join(RESERVED_MOUNT_PATHS[:-1])} or "
                       f"{RESERVED_MOUNT_PATHS[-1]}: the operator mounts its own volumes there (use a path of its own, "
                       "such as /var/cache/kaon-kv)")


class KvOffloadSpec(_Model):
    """KV cache tiers below the engine's pool (docs/kv_cache.md): blocks evicted from the pool are kept in host memory, then on disk, and come back on a prefix hit."""  # noqa: E501 - one line: the CRD's description

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _TIERS_PATH_RULE, "message": _TIERS_PATH_MESSAGE}]})

    host_bytes: int = Field(0, ge=0)
    """Host memory for evicted KV blocks (`--kv-offload-bytes`); count it in spec.resources' memory."""
    disk_bytes: int = Field(0, ge=0)
    """A disk tier below host memory (`--kv-offload-dir-bytes`), on the node's local disk (an emptyDir that outlives an engine container's restart) unless `diskPath` is a volume mounted through engine.volumeMounts (a PVC: kept across pods)."""  # noqa: E501 - one line: the CRD's description
    disk_path: str = Field("/var/cache/kaon-kv", pattern=r"^/")
    """Where the disk tier lives in the engine container (not one of the operator's own mount paths)."""

    @model_validator(mode="after")
    def _own_path(self) -> KvOffloadSpec:
        if self.disk_bytes and self.disk_path in RESERVED_MOUNT_PATHS:
            raise ValueError(_TIERS_PATH_MESSAGE)
        return self


class EngineSpec(_Model):
    """Engine settings for every replica."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": f"!has(self.volumes) || self.volumes.all(v, !(v.name in {list(RESERVED_VOLUMES)}))",
         "message": _RESERVED_VOLUME_MESSAGE},
        {"rule": f"!has(self.volumeMounts) || self.volumeMounts.all(m, !(m.mountPath in {list(RESERVED_MOUNT_PATHS)}))",
         "message": _RESERVED_PATH_MESSAGE},
        {"rule": _ONE_STAGE_PER_NODE_RULE, "message": _ONE_STAGE_PER_NODE_MESSAGE},
        {"rule": _TIERS_RULE, "message": _TIERS_MESSAGE}]})

    tensor_parallel_size: int = Field(1, ge=1, le=64)
    """GPUs per replica; the model's heads are sharded across them. They must divide the model's
    heads: the fetch (or the engine) checks, and the condition ModelDoesNotFit says so."""
    nodes_per_replica: int = Field(1, ge=1, le=64)
    """Pods (nodes) of one replica. Above 1 a replica is a LeaderWorkerSet group of this many pods, each running
    one pipeline stage on tensorParallelSize GPUs; the LeaderWorkerSet API must be installed (docs/multinode.md)."""
    pipeline_parallel_size: int = Field(1, ge=1, le=64)
    """Pipeline stages of one replica (`kaon serve --pipeline-parallel-size`): equal to nodesPerReplica, one stage per node."""  # noqa: E501 - one line: the CRD's description
    max_num_seqs: int | None = Field(None, ge=1)
    """Most sequences in one batch (`kaon serve --max-num-seqs`). Unset: the engine's own default for its device, 8 on a CPU and 64 on a GPU; the router's free-slot rule and the autoscaler's target then count 64 (or the profile's measured value)."""  # noqa: E501 - one line: the CRD's description
    max_num_batched_tokens: int | None = Field(None, ge=1)
    """Most tokens (prefill + decode) in one step (`kaon serve --max-num-batched-tokens`). Unset: the engine's own default, 1024, and 256 on the decode pods of spec.prefill."""  # noqa: E501 - one line: the CRD's description
    kv_cache_fraction: float = Field(0.85, gt=0, le=1)
    """Share of the GPU memory left after loading weights for the KV cache and the largest step's activations (measured at start)."""  # noqa: E501 - one line: the CRD's description
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes."""
    kv_offload: KvOffloadSpec | None = None
    """KV cache tiers below the pool: host memory, then disk (docs/kv_cache.md)."""
    task: Literal["generate", "embed"] = "generate"
    """`generate`: the completion routes; `embed`: /v1/embeddings for an embedding model (`kaon serve --task`)."""
    image: str = Field(DEFAULT_IMAGE, min_length=1)
    """Engine container image."""
    extra_args: list[str] = []
    """Appended to the `kaon serve` command line."""
    env: list[EnvVar] | None = None
    """Extra environment of the engine and fetch containers (e.g. HTTPS_PROXY)."""
    env_from: list[dict[str, Any]] | None = None
    """`secretRef` / `configMapRef` sources of environment for the engine and fetch containers."""
    volumes: list[Volume] | None = None
    """Extra pod volumes (e.g. a CA bundle); mount them with volumeMounts."""
    volume_mounts: list[VolumeMount] | None = None
    """Where the extra volumes appear in the engine and fetch containers."""
    image_pull_secrets: list[LocalObjectReference] | None = None
    """Secrets for pulling a private engine image."""
    startup_timeout_seconds: int = Field(1800, ge=1, le=86400)
    """How long a replica may take from its start to loading the model (the startup probe's budget);
    past it the kubelet restarts the container and the condition Degraded says StartupTimeout."""
    max_loras: int = Field(4, ge=1, le=256)
    """With spec.adapters: adapter slots per replica, the most distinct adapters running at once (`kaon serve --max-loras`); the others stay registered and are swapped in on demand."""  # noqa: E501 - one line: the CRD's description
    max_lora_rank: int = Field(16, ge=1, le=512)
    """With spec.adapters: the highest adapter rank served (`kaon serve --max-lora-rank`)."""
    stall_timeout_seconds: int = Field(120, ge=0, le=3600)
    """With requests pending and no engine step completed for this long, /health fails and the
    liveness probe restarts the replica (`kaon serve --stall-timeout`; the first step after load gets
    3x, for kernel compilation). 0 turns the check off (liveness then means only: the server answers)."""

    @model_validator(mode="after")
    def _not_reserved(self) -> EngineSpec:
        if any(v.name in RESERVED_VOLUMES for v in self.volumes or []):
            raise ValueError(_RESERVED_VOLUME_MESSAGE)
        if any(m.mount_path in RESERVED_MOUNT_PATHS for m in self.volume_mounts or []):
            raise ValueError(_RESERVED_PATH_MESSAGE)
        if self.pipeline_parallel_size != self.nodes_per_replica:
            raise ValueError(_ONE_STAGE_PER_NODE_MESSAGE)
        tiered = self.kv_offload is not None and (self.kv_offload.host_bytes or self.kv_offload.disk_bytes)
        if tiered and not (self.enable_prefix_caching and self.tensor_parallel_size == 1
                           and self.pipeline_parallel_size == 1):
            raise ValueError(_TIERS_MESSAGE)
        return self

    @property
    def multi_node(self) -> bool:
        """A replica spans several pods: a LeaderWorkerSet group instead of a Deployment's pod."""
        return self.nodes_per_replica > 1

    def batch_slots(self, measured: int | None = None) -> int:
        """Sequences one replica runs at once, as the operator's sums count them: maxNumSeqs when set, else the
        engine's own resolved value where a profile measured it, else a GPU engine's default."""
        return self.max_num_seqs or measured or ENGINE_GPU_MAX_NUM_SEQS


_NO_GPU_IN_RESOURCES = (
    f"!(has(self.requests) && '{GPU_RESOURCE}' in self.requests)"
    f" && !(has(self.limits) && '{GPU_RESOURCE}' in self.limits)")
_NO_GPU_MESSAGE = f"{GPU_RESOURCE} comes from engine.tensorParallelSize; do not set it here"


class ResourcesSpec(_Model):
    """CPU and memory (and any other resources) for the engine container; GPUs come from the engine."""

    model_config = ConfigDict(json_schema_extra=_cel(_NO_GPU_IN_RESOURCES, _NO_GPU_MESSAGE))

    requests: dict[str, Quantity] | None = Field(None, max_length=_MAX_RESOURCES)
    """Resource requests of the engine container, e.g. `{cpu: 4, memory: 16Gi}`. Unset cpu and memory default to
    2 CPUs and 8Gi per GPU (engine.tensorParallelSize), unless `limits` sets them (then the limit is the request)."""
    limits: dict[str, Quantity] | None = Field(None, max_length=_MAX_RESOURCES)
    """Resource limits of the engine container."""

    @model_validator(mode="after")
    def _no_gpu(self) -> ResourcesSpec:
        if GPU_RESOURCE in (self.requests or {}) or GPU_RESOURCE in (self.limits or {}):
            raise ValueError(_NO_GPU_MESSAGE)
        return self


class SchedulingSpec(_Model):
    """Where engine pods may run; passed through to the pod spec as written."""

    node_selector: dict[str, str] | None = None
    """Node labels the engine pods require."""
    tolerations: list[dict[str, Any]] | None = None
    """Taints the engine pods tolerate (Kubernetes `Toleration` objects)."""
    affinity: dict[str, Any] | None = None
    """Node and pod affinity of the engine pods (a Kubernetes `Affinity` object)."""


_MIN_LE_MAX = "self.minReplicas <= self.maxReplicas"
_MIN_LE_MAX_MESSAGE = "minReplicas must be <= maxReplicas"
_ZERO_NEEDS_IDLE = "self.minReplicas > 0 || has(self.scaleToZeroIdleSeconds)"
_ZERO_NEEDS_IDLE_MESSAGE = "minReplicas 0 needs scaleToZeroIdleSeconds"
_IDLE_NEEDS_ZERO = "!has(self.scaleToZeroIdleSeconds) || self.minReplicas == 0"
_IDLE_NEEDS_ZERO_MESSAGE = "scaleToZeroIdleSeconds needs minReplicas 0"
_PREDICTIVE_NEEDS_PROFILE = "self.policy != 'predictive' || (has(self.profile) && self.profile != 'none')"
_PREDICTIVE_NEEDS_PROFILE_MESSAGE = ("policy predictive needs profile: auto (the operator measures the engine) or "
                                     "the ConfigMap holding the engine's performance model")
PROFILE_KEY = "model.json"  # the key of the profile ConfigMap that holds the performance model

MAX_WINDOW_SECONDS = 3600  # the operator keeps this much history at most


class AutoscalingSpec(_Model):
    """Scale replicas on concurrency (requests in flight per replica), queue depth and P99 latency."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _MIN_LE_MAX, "message": _MIN_LE_MAX_MESSAGE},
        {"rule": _ZERO_NEEDS_IDLE, "message": _ZERO_NEEDS_IDLE_MESSAGE},
        {"rule": _IDLE_NEEDS_ZERO, "message": _IDLE_NEEDS_ZERO_MESSAGE},
        {"rule": _PREDICTIVE_NEEDS_PROFILE, "message": _PREDICTIVE_NEEDS_PROFILE_MESSAGE},
    ]})

    enabled: bool = False
    """Let the operator set `replicas` from the engines' metrics."""
    min_replicas: int = Field(1, ge=0)
    """Fewest replicas; 0 allows scale to zero (needs scaleToZeroIdleSeconds)."""
    max_replicas: int = Field(4, ge=1)
    """Most replicas."""
    target_concurrency_per_replica: float | None = Field(None, gt=0)
    """Requests (running + waiting) one replica should carry (unset: targetUtilization x engine.maxNumSeqs)."""
    target_utilization: float = Field(0.7, gt=0, le=1)
    """Share of engine.maxNumSeqs one replica should carry when targetConcurrencyPerReplica is unset."""
    target_queue_depth_per_replica: float = Field(4, gt=0)
    """Waiting requests per ready replica above which the autoscaler adds replicas."""
    target_p99_latency_seconds: float | None = Field(None, gt=0)
    """P99 of `latencyMetric` above which the autoscaler adds replicas (unset: no latency target)."""
    latency_metric: Literal["ttft", "e2e", "itl"] = "ttft"
    """Time to first token, end-to-end request latency, or inter-token latency (time per output token). With spec.prefill the decode pool is scaled on `itl` whatever this says (its prompts are prefilled elsewhere)."""  # noqa: E501 - one line: the CRD's description
    scale_up_window_seconds: int = Field(60, ge=0, le=MAX_WINDOW_SECONDS)
    """The window whose mean concurrency (and whole-window queue depth or P99) decides a scale-up; bursts of
    twice the capacity act at once."""
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=MAX_WINDOW_SECONDS)
    """How long the peak load must fit fewer replicas before scaling down."""
    max_step: int = Field(2, ge=1)
    """Most replicas added or removed by one decision."""
    scale_to_zero_idle_seconds: int | None = Field(None, ge=1, le=MAX_WINDOW_SECONDS)
    """With minReplicas 0: idle time (no requests) after which the last replica goes."""
    scale_from_zero_timeout_seconds: int = Field(600, ge=1, le=MAX_WINDOW_SECONDS)
    """How long the router holds a request while the service has no ready replica (a cold start: image pull and
    weight load), before it answers 503."""
    policy: Literal["reactive", "predictive"] = "reactive"
    """`reactive`: scale on concurrency, queue depth and the observed P99. `predictive`: size replicas from the arrival rate, the prompt and output lengths and the engine's measured performance model (`profile`), the observed P99 correcting the model."""  # noqa: E501 - one line: the CRD's description
    profile: str | None = Field(None, min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    """The engine's performance model, for `predictive`: `auto` (the operator runs a profiling Job, `kaon profile`, on the engine's own pod and keeps the model in a ConfigMap keyed by the model, device, quantization, parallelism and engine settings: a changed spec measures again), `none`, or the name of a ConfigMap in this namespace whose key `model.json` holds the model, as `kaon profile` writes it."""  # noqa: E501 - one line: the CRD's description

    standby: int = Field(0, ge=0, le=16)
    """Replicas kept scheduled, loaded and asleep beside `replicas` (with `enabled: true`: the autoscaler wakes them; while autoscaling is off there are none): a scale-up wakes one (seconds) instead of starting a pod (a cold start: minutes on a GPU), and the operator starts a new standby behind it; a scale-down puts a replica to sleep rather than cutting one. A standby costs what its pod reserves: on a GPU it keeps its device (asleep at level 1 the device memory is free, the weights wait in host memory) unless the GPU is shared, so standby trades money for latency (docs/autoscaling.md has the trade in numbers). The engine's sleep mode does not support tensor or pipeline parallelism, a draft model or a sentence encoder: there the standbys stay awake and a Warning Event (StandbyFailed) says why."""  # noqa: E501 - one line: the CRD's description

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(_MIN_LE_MAX_MESSAGE)
        if self.min_replicas == 0 and self.scale_to_zero_idle_seconds is None:
            raise ValueError(_ZERO_NEEDS_IDLE_MESSAGE)
        if self.scale_to_zero_idle_seconds is not None and self.min_replicas != 0:
            raise ValueError(_IDLE_NEEDS_ZERO_MESSAGE)
        if self.policy == "predictive" and self.profile in (None, "none"):
            raise ValueError(_PREDICTIVE_NEEDS_PROFILE_MESSAGE)
        return self


class RoutingSpec(_Model):
    """How the router picks an engine pod."""

    strategy: Literal["least-connections", "prefix-affinity", "kv-aware"] = "least-connections"
    """`least-connections`: the ready pod with the fewest requests in flight. `prefix-affinity`: the pod that holds the request's prompt prefix in its cache (a conversation's earlier turns), by consistent hashing, unless it carries more than `loadBound` times the mean load or has no free sequence slot (`engine.maxNumSeqs`) while another pod has one. `kv-aware`: the pod whose engine announces (KV events, port 5557) the longest prefix of the request's tokens in its pool, host memory or disk tier, within the same bounds."""  # noqa: E501 - one line: the CRD's description
    load_bound: float = Field(1.25, gt=1, le=10)
    """With `prefix-affinity`: a pod with more than this factor times the mean requests in flight (plus one) is passed over for the least loaded pod, unless it carries at most one request more than that pod (at light loads the factor alone would round to one or two requests)."""  # noqa: E501 - one line: the CRD's description


class AuthSpec(_Model):
    """Who may call the model: clients must send `Authorization: Bearer <key>`, at the router and at the engine pods."""

    api_key_secret: str = Field(min_length=1, max_length=253, pattern=_DNS_SUBDOMAIN)
    """An Opaque Secret in this namespace (`kubectl create secret generic`); every value in its `data` is an accepted API key (several keys for several clients; rotate by editing the Secret, no restart). A missing or empty Secret refuses every request."""  # noqa: E501 - one line: the CRD's description


class RolloutSpec(_Model):
    """How engine pods are replaced when the spec changes (a new image, model or engine setting)."""

    strategy: Literal["Surge", "Replace"] = "Surge"
    """`Surge` (default): start one new pod before taking an old one down (maxSurge 1, maxUnavailable 0), so
    capacity never dips, but the rollout waits for one spare replica's GPUs. `Replace`: take one old pod down,
    then start its replacement on the GPUs it freed (maxSurge 0, maxUnavailable 1): works in a full GPU pool, at
    the cost of one replica less while each pod reloads the model (and no replica at all with `replicas: 1`)."""


# spec.rollout.strategy -> the rolling update it means: of the Deployment's pods, or with several nodes per
# replica of the LeaderWorkerSet's groups (the same two numbers, in its units).
ROLLING_UPDATES = {"Surge": {"maxSurge": 1, "maxUnavailable": 0}, "Replace": {"maxSurge": 0, "maxUnavailable": 1}}
MAX_DRAIN_SECONDS = 3600
MAX_ADAPTERS = 64
_ADAPTER_NAME = r"^[A-Za-z0-9][-A-Za-z0-9_.]*$"
_ADAPTER_URI_RULE = "self.startsWith('hf://') || self.startsWith('s3://') || self.startsWith('pvc://')"
_ADAPTER_URI_MESSAGE = "an adapter's uri must be hf://, s3:// or pvc://"
_UNIQUE_ADAPTERS_MESSAGE = "adapter names must be unique"


class AdapterSpec(_Model):
    """A LoRA adapter (a PEFT directory: adapter_config.json + adapter_model.safetensors) served beside the model."""

    name: str = Field(min_length=1, max_length=253, pattern=_ADAPTER_NAME)
    """The name clients send as `model` (or `<namespace>/<name>` through the router); no `/`."""
    uri: str = Field(min_length=1, max_length=4096, json_schema_extra={"x-kubernetes-validations": [
        {"rule": rule, "message": message}
        for rule, message in [(_ADAPTER_URI_RULE, _ADAPTER_URI_MESSAGE), *((r, m) for r, _, m in _URI_RULES)]]})
    """`hf://<org>/<name>[@<revision>]` or `s3://<bucket>/<prefix>` (with the model's credentialsSecret and endpoint), or `pvc://<claim>/<path>`."""  # noqa: E501 - one line: the CRD's description

    @field_validator("uri")
    @classmethod
    def _known_scheme(cls, v: str) -> str:
        if not v.startswith(("hf://", "s3://", "pvc://")):
            raise ValueError(_ADAPTER_URI_MESSAGE)
        for _, check, message in _URI_RULES:
            if not check(v):
                raise ValueError(message)
        return v


# /v1/embeddings runs on the base model (kaon serve --task embed), and a sentence encoder's server refuses
# --enable-runtime-lora at start: adapters beside engine.task embed are never served, or crash-loop the pods.
_ADAPTERS_GENERATE_MESSAGE = ("adapters need engine.task generate: an embedding runs on the base model, and a "
                              "sentence encoder takes no LoRA adapters")
_PREFILL_ONE_PROCESS_MESSAGE = ("prefill (disaggregation) needs engine.tensorParallelSize 1, engine.nodesPerReplica 1 "
                                 "and engine.task generate: each engine's K/V moves from one process")


class PrefillAutoscalingSpec(_Model):
    """Scale the prefill pool (spec.prefill.replicas) on its own signals: prompt tokens queued on the prefill engines and the decode engines' time to first token (the transfer included); the decode pool scales on spec.autoscaling."""  # noqa: E501 - one line: the CRD's description

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": _MIN_LE_MAX, "message": _MIN_LE_MAX_MESSAGE}]})

    enabled: bool = False
    """Let the operator set spec.prefill.replicas."""
    min_replicas: int = Field(1, ge=0)
    """Fewest prefill replicas (0: the decode engines prefill everything themselves)."""
    max_replicas: int = Field(4, ge=1)
    """Most prefill replicas."""
    target_queued_prompt_tokens_per_replica: float = Field(4096, gt=0)
    """Prompt tokens waiting on one prefill replica above which replicas are added (`kaon_num_prompt_tokens_waiting`: waiting or mid-prefill)."""  # noqa: E501 - one line: the CRD's description
    target_p99_ttft_seconds: float | None = Field(None, gt=0)
    """P99 time to first token on the decode engines above which a prefill replica is added (unset: no TTFT target)."""
    scale_down_stabilization_seconds: int = Field(300, ge=0, le=MAX_WINDOW_SECONDS)
    """How long after the last change before a replica may go."""
    max_step: int = Field(2, ge=1)
    """Most replicas added or removed by one decision."""

    @model_validator(mode="after")
    def _consistent(self) -> PrefillAutoscalingSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(_MIN_LE_MAX_MESSAGE)
        return self


class PrefillSpec(_Model):
    """A pool of prefill engines (prefill/decode disaggregation, docs/disaggregation.md): they compute long prompts' K/V and stream it to the decode engines (the rest of the spec), which the router keeps sending requests to."""  # noqa: E501 - one line: the CRD's description

    replicas: int = Field(1, ge=0)
    """Prefill engine replicas (0: the decode engines prefill everything themselves)."""
    resources: ResourcesSpec | None = None
    """The prefill pods' resources (unset: the same as the decode pods', spec.resources)."""
    min_prompt_tokens: int | None = Field(None, ge=1)
    """Prompts with fewer tokens missing from a decode engine's prefix cache are prefilled there (`kaon serve --disagg-min-prompt-tokens`; unset: the engine's default)."""  # noqa: E501 - one line: the CRD's description
    timeout_seconds: int = Field(30, ge=1, le=600)
    """A transfer not complete by then is given up and the decode engine prefills the prompt itself."""
    autoscaling: PrefillAutoscalingSpec = Field(default_factory=PrefillAutoscalingSpec,
                                                json_schema_extra=_default(PrefillAutoscalingSpec))
    """The prefill pool's own autoscaler (docs/disaggregation.md)."""


class InferenceServiceSpec(_Model):
    """The desired state of an InferenceService."""

    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": [
        {"rule": "!has(self.prefill) || ((!has(self.engine.tensorParallelSize) || self.engine.tensorParallelSize == 1)"
                 " && (!has(self.engine.nodesPerReplica) || self.engine.nodesPerReplica == 1)"
                 " && (!has(self.engine.task) || self.engine.task == 'generate'))",
         "message": _PREFILL_ONE_PROCESS_MESSAGE},
        {"rule": "!has(self.adapters) || size(self.adapters) == 0 || !has(self.engine.task)"
                 " || self.engine.task == 'generate'",
         "message": _ADAPTERS_GENERATE_MESSAGE}]})

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec, json_schema_extra=_default(EngineSpec))
    resources: ResourcesSpec | None = None
    scheduling: SchedulingSpec | None = None
    replicas: int = Field(1, ge=0)
    """Engine replicas; the autoscaler sets this when autoscaling is enabled (so does `kubectl scale`)."""
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, json_schema_extra=_default(AutoscalingSpec))
    routing: RoutingSpec = Field(default_factory=RoutingSpec, json_schema_extra=_default(RoutingSpec))
    adapters: list[AdapterSpec] = Field([], max_length=MAX_ADAPTERS, json_schema_extra={
        # the apiserver refuses two entries of one name (a list-map keyed by name)
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """LoRA adapters of the model, each requested by its name as `model`. Adding or removing one loads or unloads it on the running replicas, without a restart. Only with engine.task generate (an embedding runs on the base model; a sentence encoder takes none)."""  # noqa: E501 - one line: the CRD's description
    auth: AuthSpec | None = None
    """API keys the router and the engines require; without it the model answers anyone who can reach it (see docs/security.md)."""  # noqa: E501 - one line: the CRD's description
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, json_schema_extra=_default(RolloutSpec))
    prefill: PrefillSpec | None = None
    """An optional pool of prefill engines; the rest of the spec describes the decode pool (docs/disaggregation.md)."""
    drain_seconds: int = Field(30, ge=0, le=MAX_DRAIN_SECONDS)
    """Seconds an engine pod being stopped (rollout, scale-down, node drain) gives its in-flight requests to
    finish, while it answers new ones with 503 and /ready fails (`kaon serve --drain-timeout`); the pod's
    terminationGracePeriodSeconds is this plus a margin for the server's own shutdown."""


    @model_validator(mode="after")
    def _prefill_one_process(self) -> InferenceServiceSpec:
        engine = self.engine
        if self.prefill is not None and (engine.tensor_parallel_size > 1 or engine.nodes_per_replica > 1
                                         or engine.task != "generate"):
            raise ValueError(_PREFILL_ONE_PROCESS_MESSAGE)
        return self

    @model_validator(mode="after")
    def _adapters_generate(self) -> InferenceServiceSpec:
        if self.adapters and self.engine.task != "generate":
            raise ValueError(_ADAPTERS_GENERATE_MESSAGE)
        return self

    @field_validator("adapters")
    @classmethod
    def _unique_adapters(cls, v: list[AdapterSpec]) -> list[AdapterSpec]:
        if len({a.name for a in v}) != len(v):
            raise ValueError(_UNIQUE_ADAPTERS_MESSAGE)
        return v


def parse_spec(spec: Mapping[str, Any]) -> InferenceServiceSpec | str:
    """The spec as a model, or why it is invalid (one line, for the status)."""
    try:
        return InferenceServiceSpec.model_validate(dict(spec))
    except ValidationError as exc:
        return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'spec'}: {e['msg']}" for e in exc.errors())
