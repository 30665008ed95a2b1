"""`spec.autoscaling.profile: auto`: the profiling Job, the ConfigMap it fills, and when to run it.

Pure functions; the I/O is profile_sync.py's.

- **The key**: what the engine's speed depends on and the spec says: the model (URI, revision,
  GGUF file, quantization, max length), the engine image, tensor and pipeline parallelism, the
  batch limits and KV cache share, the extra arguments (`--dtype`, `--kv-cache-dtype` ride
  there) and the device: the GPU type the pods are pinned to by `nodeSelector`
  (`nvidia.com/gpu.product`, as GPU feature discovery labels nodes), else `any`. Its SHA-256
  digest names the Job and the ConfigMap (`<service>-profile-<digest>`), so a changed spec
  looks for another profile and the old one is never read again.
- **Clean-up** (`stale`): once the current key's ConfigMap holds a readable model, the Jobs and
  ConfigMaps of other keys that this InferenceService controls are deleted (a Job with its pods);
  so are all of them once the setting is `none`, unset or a named ConfigMap, except the one it
  names (a user may name an auto one to keep a measured model after a spec change). Found by
  their labels (the service's, component `profiler`, the key's digest), and never an object
  another controller holds. The rest go with the service.
- **The Job** runs the engine's own pod (same image, model volume or fetch, resources, GPU
  count, node selection, environment) with `kaon profile ... -- <the kaon serve arguments>`
  in place of `kaon serve` (without spec.auth: it serves only itself, on loopback), once
  (backoffLimit 0), kept an hour after it ends (its log), then garbage-collected; a failed one
  is so tried again an hour later, or at once when deleted.
- **How the model gets out**: `kaon profile --out /dev/termination-log --max-bytes 4096`; the
  operator reads the terminated container's message and writes the ConfigMap itself. Why the
  termination message: the engine pod keeps no ServiceAccount token (it never talks to the
  apiserver) and no Role is needed for a pod the user's spec shapes (image, env, args); the
  operator, which may already read pods and write ConfigMaps, is the one writer. The model
  fits: the coefficients take ~400 bytes and `kaon profile` leaves grid points out evenly
  until the whole fits the kubelet's 4 KiB.
- **Whose objects are read**: labels and names can be chosen by anyone who may write in the
  namespace, so auto's ConfigMap and Job are trusted only when this InferenceService's uid is their
  controller, and the Job's pods only when the Job's uid is theirs (`controlled_by`). Anything else
  under those names or labels (`strangers`) is ignored (a pre-made ConfigMap cannot plant a model,
  a labelled pod cannot end the measurement with its own message), and reported with an Event.
"""
from __future__ import annotations

import enum
import hashlib
import json
from dataclasses import dataclass

from kaon_operator import api, labels
from kaon_operator.autoscaling.perf_model import PerfModel
from kaon_operator.children import ownership, pod_template, resources

AUTO, NONE = "auto", "none"
PROFILER = "profiler"  # the component label of the Job, its pod and the ConfigMap
KEY_LABEL = "kaon.dev/profile-key"
KEY_ANNOTATION = "kaon.dev/profile-key"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CONTAINER = "profile"
TERMINATION_MESSAGE_BYTES = 4096  # the kubelet keeps this much of a termination message
JOB_TTL_SECONDS = 3600  # a finished Job (and its pod's log) stays this long; a failed one is retried after
PROFILE_SECONDS = 3600  # the grid's measurement, on top of the engine's own start-up budget
DIGEST_CHARS = 10


def profile_key(spec: api.InferenceServiceSpec) -> dict:
    """What a performance model was measured on, as the spec says it (see the module's docstring)."""
    model, engine = spec.model, spec.engine
    selector = (spec.scheduling.node_selector if spec.scheduling else None) or {}
    return {"model": model.uri, "revision": model.revision, "ggufFile": model.gguf_file,
            "quantization": model.quantization, "maxModelLen": model.max_model_len, "image": engine.image,
            "tensorParallelSize": engine.tensor_parallel_size, "pipelineParallelSize": engine.pipeline_parallel_size,
            "maxNumSeqs": engine.max_num_seqs, "maxNumBatchedTokens": engine.max_num_batched_tokens,
            "kvCacheFraction": engine.kv_cache_fraction, "extraArgs": list(engine.extra_args),
            "device": selector.get(GPU_PRODUCT_LABEL, "any")}


def key_digest(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]


def object_name(service: str, digest: str) -> str:
    """The Job's and the ConfigMap's name: within 63 characters (a Job's name is a pod label's value)."""
    suffix = f"-profile-{digest}"
    return f"{service[:63 - len(suffix)].rstrip('-')}{suffix}"


def config_map_name(service: str, setting: str | None, spec: api.InferenceServiceSpec) -> str | None:
    """The ConfigMap holding the model: auto's (by the key), the one named, or None (`none`, unset)."""
    if setting is None or setting == NONE:
        return None
    return object_name(service, key_digest(profile_key(spec))) if setting == AUTO else setting


def _metadata(owner: resources.Owner, name: str, digest: str, key: dict) -> dict:
    return {"name": name, "namespace": owner.namespace,
            "labels": {**labels.service_labels(owner.name, PROFILER), KEY_LABEL: digest},
            "annotations": {KEY_ANNOTATION: json.dumps(key, sort_keys=True)},
            "ownerReferences": [resources.owner_reference(owner)]}


def profile_args(serve_args: list[str]) -> list[str]:
    """`kaon serve ...` -> `kaon profile ... -- ...`, the model written to the termination message."""
    return ["kaon", "profile", "--out", pod_template.TERMINATION_LOG,
            "--max-bytes", str(TERMINATION_MESSAGE_BYTES), "--", *serve_args[2:]]


def job(owner: resources.Owner, spec: api.InferenceServiceSpec) -> dict:
    """The profiling Job of the InferenceService `owner` (see the module's docstring)."""
    key = profile_key(spec)
    digest = key_digest(key)
    name = object_name(owner.name, digest)
    pod = pod_template.pod_spec(owner.name, spec.model_copy(update={"auth": None}))
    engine = pod["containers"][0]
    for unused in ("startupProbe", "livenessProbe", "readinessProbe", "ports"):
        engine.pop(unused, None)
    engine.update(name=CONTAINER, args=profile_args(engine["args"]))
    pod["restartPolicy"] = "Never"
    meta = _metadata(owner, name, digest, key)
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
            "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": JOB_TTL_SECONDS,
                     "activeDeadlineSeconds": pod_template.progress_deadline_seconds(spec) + PROFILE_SECONDS,
                     "template": {"metadata": {"labels": meta["labels"]}, "spec": pod}}}


def config_map(owner: resources.Owner, spec: api.InferenceServiceSpec, model_json: str) -> dict:
    key = profile_key(spec)
    digest = key_digest(key)
    return {"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": _metadata(owner, object_name(owner.name, digest), digest, key),
            "data": {api.PROFILE_KEY: model_json}}


def pod_selector(service: str, digest: str) -> str:
    """The profiling pods of one key."""
    return f"{labels.SERVICE}={service},{labels.COMPONENT}={PROFILER},{KEY_LABEL}={digest}"


PROFILE_KINDS = (("batch/v1", "Job"), ("v1", "ConfigMap"))  # what profile: auto makes, in the order cleaned


def profile_selector(service: str) -> str:
    """Every profiling Job and ConfigMap of one service, whatever its key."""
    return f"{labels.SERVICE}={service},{labels.COMPONENT}={PROFILER}"


def stale(objects: list[dict], owner: resources.Owner, keep_digest: str | None = None,
          keep_name: str | None = None) -> list[dict]:
    """The profiling Jobs and ConfigMaps among `objects` that no setting reads any more: those of the
    InferenceService `owner` (its labels and its uid as their controller) whose key digest is not
    `keep_digest` (auto's current key) and whose name is not `keep_name` (a ConfigMap the spec names).
    Both None: all of them (profile `none` or unset)."""
    def is_stale(obj: dict) -> bool:
        meta = obj.get("metadata") or {}
        found = meta.get("labels") or {}
        return (found.get(labels.SERVICE) == owner.name and found.get(labels.COMPONENT) == PROFILER
                and KEY_LABEL in found and found[KEY_LABEL] != keep_digest
                and meta.get("namespace", owner.namespace) == owner.namespace and meta.get("name") != keep_name
                and bool(owner.uid) and (ownership.controller(obj) or {}).get("uid") == owner.uid)
    return [obj for obj in objects if is_stale(obj)]


def cleaned_message(removed: list[dict]) -> str:
    """The Normal event's message: what was deleted, as `Job a, ConfigMap a`."""
    return ("deleted the profiling objects of an earlier spec (spec.autoscaling.profile): "
            + ", ".join(f"{obj['kind']} {obj['metadata']['name']}" for obj in removed))


# The Job's progress and what to do next ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class JobState:
    finished: bool
    succeeded: bool
    message: str
    """Its pod's termination message: the model on success, why not on failure."""
    uid: str = ""


def controlled_by(obj: dict, uid: str | None) -> bool:
    """Whether `uid` (an InferenceService's, a Job's) is the object's controller."""
    return bool(uid) and (ownership.controller(obj) or {}).get("uid") == uid


def strangers(objects: list[dict], uid: str | None) -> list[str]:
    """`Kind name` of each object not controlled by `uid`: what a name or a label alone does not make ours."""
    return [f"{obj.get('kind') or 'Pod'} {(obj.get('metadata') or {}).get('name')}"
            for obj in objects if not controlled_by(obj, uid)]


def job_state(job_body: dict, pods: list[dict]) -> JobState:
    """What the Job and its pod say: running, succeeded with the model, or failed and why. Only the
    pods the Job controls are read (a pod that only carries the labels says nothing)."""
    job_uid = (job_body.get("metadata") or {}).get("uid")
    pods = [p for p in pods if controlled_by(p, job_uid)]
    conditions = {c.get("type"): c for c in (job_body.get("status") or {}).get("conditions") or []
                  if c.get("status") == "True"}
    uid = job_body.get("metadata", {}).get("uid", "")
    messages = [s["state"]["terminated"].get("message") or "" for p in pods
                for s in (p.get("status") or {}).get("containerStatuses") or []
                if s.get("name") == CONTAINER and "terminated" in (s.get("state") or {})]
    if "Complete" in conditions:
        return JobState(True, True, next((m for m in messages if m), ""), uid)
    if "Failed" in conditions:
        why = conditions["Failed"]
        detail = next((m for m in messages if m), "") or why.get("message") or why.get("reason") or "failed"
        return JobState(True, False, detail.strip().splitlines()[-1] if detail.strip() else "failed", uid)
    return JobState(False, False, "", uid)


class Step(enum.Enum):
    USE = "use"  # the ConfigMap holds a model
    RUN = "run"  # no Job for this key: create it
    WAIT = "wait"  # the Job is measuring
    SAVE = "save"  # the Job succeeded: write its model to the ConfigMap
    FAILED = "failed"  # the Job failed (or wrote no model): until it is gone, run nothing


def read_model(text: str | None) -> PerfModel | None:
    try:
        return PerfModel.from_json(text) if text else None
    except (ValueError, TypeError, KeyError):
        return None


def next_step(saved: PerfModel | None, state: JobState | None) -> Step:
    """What profile: auto does now, from the ConfigMap's model and the Job (None: there is none)."""
    if saved is not None:
        return Step.USE
    if state is None:
        return Step.RUN
    if not state.finished:
        return Step.WAIT
    return Step.SAVE if state.succeeded and read_model(state.message) is not None else Step.FAILED


def failure(state: JobState) -> str:
    if state.succeeded:
        return "it ended without writing a performance model to its termination message"
    return state.message
