"""Pure functions from an InferenceService's spec to its engine pod: the `kaon fetch` init
container, the `kaon serve` container, probes, volumes, environment and scheduling.

resources.py wraps the pod in the Deployment; status (summaries.py) reads the same pods back
by the container names defined here.

Just over 300 lines for a stated reason: the leader and worker pods of a multi-node group are
the same pod with different probes, so both are built here rather than in a second copy.
"""
from __future__ import annotations

import math

from kaon_operator import api
from kaon_operator.autoscaling import standby
from kaon_operator.children import disagg_args, kv_cache_args
from kaon_operator.lora import adapter_pods

ENGINE_CONTAINER = "engine"
FETCH_CONTAINER = "fetch"  # the init container: `kaon fetch`
HTTP_PORT = 8000
# `kaon serve --drain-timeout` (spec.drainSeconds): in-flight requests get this long after SIGTERM.
# The kubelet must not SIGKILL before the drain and uvicorn's shutdown are over, hence the margin.
TERMINATION_GRACE_MARGIN_SECONDS = 15
DRAIN_SECONDS = api.InferenceServiceSpec.model_fields["drain_seconds"].default  # as `kaon serve`'s
# Loading (and quantizing) a large model can take many minutes; liveness waits for it.
STARTUP_PERIOD_SECONDS = 10
STARTUP_FAILURE_THRESHOLD = 180  # 30 minutes
READINESS_PERIOD_SECONDS = 5
READINESS_FAILURE_THRESHOLD = 2
# The Deployment's progressDeadlineSeconds: the startup probe's whole budget, plus this for scheduling,
# the image pull and the server's start; plus FETCH_ALLOWANCE_SECONDS when the init container downloads
# the model first (the startup probe only starts after it). A big model may take all of it without
# ever showing a false ProgressDeadlineExceeded; a pod stuck for a reason of its own is reported sooner
# by the Degraded condition (Unschedulable, CrashLoopBackOff, StartupTimeout, ...).
PROGRESS_MARGIN_SECONDS = 600
FETCH_ALLOWANCE_SECONDS = 3600
# CPU and memory requested per GPU when spec.resources leaves them out: the HTTP server, the tokenizer,
# the scheduler loop and one worker process per GPU, and the host copy of the weights while they load.
DEFAULT_REQUESTS_PER_GPU = {"cpu": 2, "memory_gib": 8}
SHM_GIB_PER_GPU = 2  # tensor-parallel workers exchange tensors through /dev/shm
CACHE_DIR = api.OWN_VOLUMES["cache"]  # Triton and Hugging Face caches, model downloads
NODE_CACHE_ROOT = "/var/lib/kaon/cache"  # spec.model.cache.node: one folder a namespace, on the node
NAMESPACE_ENV = "KAON_POD_NAMESPACE"
MODEL_CACHE_DIR = f"{CACHE_DIR}/models"  # `kaon fetch` writes hf:// and s3:// models here
MODEL_MOUNT = api.OWN_VOLUMES["model"]  # a pvc:// model's claim, read-only
TMP_DIR, SHM_DIR = api.OWN_VOLUMES["tmp"], api.OWN_VOLUMES["dshm"]
RUN_AS = 1000
# Where a kubelet puts a container's termination message; `kaon fetch` writes its one-line reason there.
TERMINATION_LOG = "/dev/termination-log"
API_KEYS_MOUNT = "/etc/kaon/api-keys"  # spec.auth.apiKeySecret, one file per key (`kaon serve --api-key-file`)
FETCHED_SCHEMES = ("hf://", "s3://")
# Keys of spec.model.credentialsSecret that the fetch init container reads, per scheme (all optional:
# a public repository needs no token, and a missing key is reported by the fetch as unauthorized).
CREDENTIAL_KEYS = {"hf://": ("HF_TOKEN",),
                   "s3://": ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")}


def _scheme(uri: str) -> str | None:
    return next((s for s in (*FETCHED_SCHEMES, "pvc://") if uri.startswith(s)), None)


def pvc_source(uri: str) -> tuple[str, str]:
    """pvc://claim/sub/path -> (claim, "sub/path")."""
    claim, _, sub = uri[len("pvc://"):].partition("/")
    return claim, sub.strip("/")


def model_location(model: api.ModelSpec) -> list[str]:
    """The model flags `kaon serve` and `kaon fetch` share: where the model is inside the pod."""
    if model.uri.startswith("pvc://"):
        _, sub = pvc_source(model.uri)
        return ["--model", f"{MODEL_MOUNT}/{sub}" if sub else MODEL_MOUNT]
    args = ["--model", model.uri]
    if _scheme(model.uri) in FETCHED_SCHEMES:
        args += ["--model-cache", MODEL_CACHE_DIR]
        if model.revision:
            args += ["--revision", model.revision]
        if model.gguf_file:
            args += ["--gguf-file", model.gguf_file]
    return args


def fetch_args(spec: api.InferenceServiceSpec) -> list[str]:
    """The `kaon fetch` command line of the init container: download (hf://, s3://) or look at (pvc://)
    the model, check that tensorParallelSize fits its heads, and say why not in one line."""
    # The node cache is bounded by sizeLimit: the least recently used models no pod uses go (kaon fetch's sweep).
    bound = ["--cache-limit", str(spec.model.cache.size_limit)] \
        if spec.model.cache.node and _scheme(spec.model.uri) in FETCHED_SCHEMES else []
    return ["kaon", "fetch", *model_location(spec.model), *bound,
            "--tensor-parallel-size", str(spec.engine.tensor_parallel_size), "--termination-log", TERMINATION_LOG]


def engine_args(name: str, spec: api.InferenceServiceSpec) -> list[str]:
    """The `kaon serve` command line of the InferenceService `name`."""
    model, engine = spec.model, spec.engine
    args = ["kaon", "serve", *model_location(model), "--served-model-name", api.served_name(model, name),
            "--host", "0.0.0.0", "--port", str(HTTP_PORT), "--drain-timeout", str(spec.drain_seconds),
            "--tensor-parallel-size", str(engine.tensor_parallel_size),
            *(["--pipeline-parallel-size", str(engine.pipeline_parallel_size)] if engine.multi_node else []),
            *batch_args(engine), "--kv-cache-fraction", str(engine.kv_cache_fraction),
            "--stall-timeout", str(engine.stall_timeout_seconds), "--task", engine.task]
    if model.quantization != "none":
        args += ["--quantization", model.quantization]
    if model.max_model_len is not None:
        args += ["--max-model-len", str(model.max_model_len)]
    if not engine.enable_prefix_caching:
        args.append("--no-enable-prefix-caching")
    if spec.auth is not None:  # the same keys as the router's, so pod-IP access needs one too
        args += ["--api-key-file", API_KEYS_MOUNT]
    return (args + adapter_pods.engine_args(spec) + standby.engine_args(spec) + disagg_args.decode_args(name, spec)
            + kv_cache_args.engine_args(spec) + list(engine.extra_args))


def batch_args(engine: api.EngineSpec) -> list[str]:
    """The batch limits the spec sets, as flags; an unset one is left to the engine, whose default depends on what
    only the pod knows: its device (--max-num-seqs 8 on a CPU, 64 on a GPU) and its role (a decode pod's
    256-token steps)."""
    args = []
    if engine.max_num_seqs is not None:
        args += ["--max-num-seqs", str(engine.max_num_seqs)]
    if engine.max_num_batched_tokens is not None:
        args += ["--max-num-batched-tokens", str(engine.max_num_batched_tokens)]
    return args


def default_requests(spec: api.InferenceServiceSpec) -> dict[str, str]:
    """CPU and memory requests for the keys spec.resources sets in neither requests nor limits (a limit
    without a request makes Kubernetes request the limit, which a default must not undercut)."""
    given = spec.resources or api.ResourcesSpec()
    taken = set(given.requests or {}) | set(given.limits or {})
    gpus = spec.engine.tensor_parallel_size
    defaults = {"cpu": str(DEFAULT_REQUESTS_PER_GPU["cpu"] * gpus),
                "memory": f"{DEFAULT_REQUESTS_PER_GPU['memory_gib'] * gpus}Gi"}
    return {k: v for k, v in defaults.items() if k not in taken}


def _resources(spec: api.InferenceServiceSpec) -> dict:
    gpus = str(spec.engine.tensor_parallel_size)
    given = spec.resources or api.ResourcesSpec()
    # Extended resources must have requests == limits; the CRD refuses a GPU count in spec.resources.
    return {"requests": {**default_requests(spec), **{k: str(v) for k, v in (given.requests or {}).items()},
                         api.GPU_RESOURCE: gpus},
            "limits": {**{k: str(v) for k, v in (given.limits or {}).items()}, api.GPU_RESOURCE: gpus}}


def termination_grace_seconds(spec: api.InferenceServiceSpec) -> int:
    return spec.drain_seconds + TERMINATION_GRACE_MARGIN_SECONDS


def startup_budget_seconds(spec: api.InferenceServiceSpec | None = None) -> int:
    """How long a started engine may take to load its model before the kubelet restarts it."""
    if spec is None:
        return STARTUP_PERIOD_SECONDS * STARTUP_FAILURE_THRESHOLD
    probe = startup_probe(spec.engine)
    return probe["periodSeconds"] * probe["failureThreshold"]


def progress_deadline_seconds(spec: api.InferenceServiceSpec) -> int:
    fetch = FETCH_ALLOWANCE_SECONDS if _scheme(spec.model.uri) in FETCHED_SCHEMES else 0
    return (startup_budget_seconds(spec) + READINESS_PERIOD_SECONDS * READINESS_FAILURE_THRESHOLD
            + PROGRESS_MARGIN_SECONDS + fetch)


def _probe(path: str, *, period: int, failures: int, timeout: int = 5) -> dict:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period,
            "failureThreshold": failures, "timeoutSeconds": timeout}


# A container killed by its startup or liveness probe is loading or hung: nothing to drain, so the
# kubelet need not wait the pod's whole grace period (a SIGSTOPped process ignores SIGTERM).
PROBE_KILL_GRACE_SECONDS = 10


def startup_probe(engine: api.EngineSpec) -> dict:
    """/health every 10 s for spec.engine.startupTimeoutSeconds (finer periods for short budgets)."""
    budget = engine.startup_timeout_seconds
    period = max(1, min(STARTUP_PERIOD_SECONDS, budget // 10))
    return {**_probe("/health", period=period, failures=math.ceil(budget / period), timeout=min(5, period)),
            "terminationGracePeriodSeconds": PROBE_KILL_GRACE_SECONDS}


def liveness_probe(engine: api.EngineSpec) -> dict:
    """/health (503 once the engine has stalled past stallTimeoutSeconds, or silence from a hung
    process) three times in a row; probed often enough that a hang is caught within about a quarter
    of the stall timeout more (every 10 s at the default 120 s)."""
    stall = engine.stall_timeout_seconds
    period = max(1, min(10, stall // 12)) if stall else 10
    return {**_probe("/health", period=period, failures=3, timeout=min(5, period)),
            "terminationGracePeriodSeconds": PROBE_KILL_GRACE_SECONDS}


def _cache_volume(spec: api.InferenceServiceSpec) -> dict:
    """The model cache: a shared (ReadWriteMany) claim when the spec names one, the node's folder with
    cache.node (a pod on a node that has the model finds it there: no download), else a per-pod emptyDir."""
    cache = spec.model.cache
    if cache.node:
        return {"name": "cache", "hostPath": {"path": NODE_CACHE_ROOT, "type": "DirectoryOrCreate"}}
    if cache.persistent_volume_claim:
        return {"name": "cache", "persistentVolumeClaim": {"claimName": cache.persistent_volume_claim}}
    return {"name": "cache", "emptyDir": {"sizeLimit": str(cache.size_limit)}}


def _volumes(spec: api.InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    volumes = [_cache_volume(spec), {"name": "tmp", "emptyDir": {}}]
    mounts: list[dict] = [{"name": "cache", "mountPath": CACHE_DIR}, {"name": "tmp", "mountPath": TMP_DIR}]
    if spec.model.cache.node:  # the namespace's own folder on the node: one tenant's models are not another's
        mounts[0]["subPathExpr"] = f"$({NAMESPACE_ENV})"
    if spec.model.uri.startswith("pvc://"):
        claim, _ = pvc_source(spec.model.uri)
        volumes.append({"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}})
        mounts.append({"name": "model", "mountPath": MODEL_MOUNT, "readOnly": True})
    tp = spec.engine.tensor_parallel_size
    if tp > 1:
        volumes.append({"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{tp * SHM_GIB_PER_GPU}Gi"}})
        mounts.append({"name": "dshm", "mountPath": SHM_DIR})
    if spec.auth is not None:
        # Not optional: without its keys the engine does not start (the pod's events say FailedMount),
        # rather than serving with none. The kubelet refreshes the files when the Secret changes.
        volumes.append({"name": "api-keys", "secret": {"secretName": spec.auth.api_key_secret, "defaultMode": 0o440}})
        mounts.append({"name": "api-keys", "mountPath": API_KEYS_MOUNT, "readOnly": True})
    adapter_volumes, adapter_mounts = adapter_pods.volumes(spec)
    volumes, mounts = volumes + adapter_volumes, mounts + adapter_mounts
    tier_volumes, tier_mounts = kv_cache_args.volumes(spec)  # the KV disk tier (spec.engine.kvOffload)
    volumes, mounts = volumes + tier_volumes, mounts + tier_mounts
    engine = spec.engine
    volumes += [v.model_dump(by_alias=True, exclude_none=True) for v in engine.volumes or []]
    mounts += [m.model_dump(by_alias=True, exclude_none=True) for m in engine.volume_mounts or []]
    return volumes, mounts


def _unique(env: list[dict]) -> list[dict]:
    """One entry per name, the last one given (server-side apply refuses duplicate names)."""
    last = {e["name"]: e for e in env}
    return [last[name] for name in dict.fromkeys(e["name"] for e in env)]


def _env(spec: api.InferenceServiceSpec) -> list[dict]:
    """The environment of both containers: the caches on the cache volume, then the spec's own."""
    node = [{"name": NAMESPACE_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}] \
        if spec.model.cache.node else []
    return _unique([*node, {"name": "XDG_CACHE_HOME", "value": CACHE_DIR},
            {"name": "HF_HOME", "value": f"{CACHE_DIR}/huggingface"},
            {"name": "TRITON_CACHE_DIR", "value": f"{CACHE_DIR}/triton"},
            {"name": "HOME", "value": TMP_DIR},
            *(e.model_dump(by_alias=True, exclude_none=True) for e in spec.engine.env or [])])


def _credentials_env(model: api.ModelSpec) -> list[dict]:
    """The fetch's credentials, read from the Secret by the kubelet (never written into the spec)."""
    scheme = _scheme(model.uri)
    env = []
    if model.credentials_secret and scheme in CREDENTIAL_KEYS:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": model.credentials_secret, "key": key,
                                                             "optional": True}}}
                for key in CREDENTIAL_KEYS[scheme]]
    if model.endpoint:  # the spec's endpoint wins over the Secret's
        env.append({"name": "HF_ENDPOINT" if scheme == "hf://" else "AWS_ENDPOINT_URL", "value": model.endpoint})
    return _unique(env)


def _fetch_container(spec: api.InferenceServiceSpec, mounts: list[dict]) -> dict:
    container = {
        "name": FETCH_CONTAINER,
        "image": spec.engine.image,
        "args": fetch_args(spec),
        "env": _unique([*_credentials_env(spec.model), *_env(spec)]),
        "volumeMounts": mounts,
        # The reason of a failure (unauthorized, not found, no space, does not fit) reaches the pod's
        # status: kaon fetch writes it to the termination log, else the log's tail stands in.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _SECURITY_CONTEXT,
    }
    if spec.engine.env_from:
        container["envFrom"] = list(spec.engine.env_from)
    return container


_SECURITY_CONTEXT = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                     "capabilities": {"drop": ["ALL"]}}


def _container(name: str, spec: api.InferenceServiceSpec, mounts: list[dict]) -> dict:
    return {
        "name": ENGINE_CONTAINER,
        "image": spec.engine.image,
        "args": engine_args(name, spec),
        "ports": [{"name": "http", "containerPort": HTTP_PORT, "protocol": "TCP"},
                  *kv_cache_args.container_ports(spec)],
        "env": _unique([*adapter_pods.engine_env(spec), *_env(spec), *adapter_pods.admin_env(spec, name)]),
        **({"envFrom": list(spec.engine.env_from)} if spec.engine.env_from else {}),
        "resources": _resources(spec),
        # /health answers once the model is loaded; until then only the startup probe runs.
        "startupProbe": startup_probe(spec.engine),
        "livenessProbe": liveness_probe(spec.engine),
        "readinessProbe": _probe("/ready", period=standby.readiness_period(spec, READINESS_PERIOD_SECONDS),
                                 failures=READINESS_FAILURE_THRESHOLD),
        "volumeMounts": mounts,
        # The engine's start error (e.g. a tensorParallelSize that does not fit the model) reaches the status.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": _SECURITY_CONTEXT,
    }


def _tolerations(spec: api.InferenceServiceSpec) -> list[dict]:
    # GPU nodes are commonly tainted so that only GPU pods land there.
    gpu = {"key": api.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
    given = (spec.scheduling.tolerations if spec.scheduling else None) or []
    return [gpu, *(t for t in given if t != gpu)]


def pod_spec(name: str, spec: api.InferenceServiceSpec) -> dict:
    """The engine pod of the InferenceService `name`."""
    volumes, mounts = _volumes(spec)
    pod = {
        "containers": [_container(name, spec, mounts)],
        "volumes": volumes,
        "terminationGracePeriodSeconds": termination_grace_seconds(spec),
        "securityContext": {"runAsNonRoot": True, "runAsUser": RUN_AS, "runAsGroup": RUN_AS, "fsGroup": RUN_AS,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "automountServiceAccountToken": False,  # the engine never talks to the apiserver
        "enableServiceLinks": False,
        "tolerations": _tolerations(spec),
    }
    if _scheme(spec.model.uri):  # hf://, s3://: download; pvc://: look. Either way, fail with a reason.
        pod["initContainers"] = [_fetch_container(spec, mounts)]
    if gates := adapter_pods.readiness_gates(spec):  # not Ready before its adapters are loaded
        pod["readinessGates"] = gates
    if spec.engine.image_pull_secrets:
        pod["imagePullSecrets"] = [s.model_dump() for s in spec.engine.image_pull_secrets]
    scheduling = spec.scheduling or api.SchedulingSpec()
    if scheduling.node_selector:
        pod["nodeSelector"] = dict(scheduling.node_selector)
    if scheduling.affinity:
        pod["affinity"] = scheduling.affinity
    return pod
