"""What spec.adapters (LoRA) adds to the engine pod, as pure functions; pod_template.py calls them.

Adapters are loaded at run time (`POST /v1/load_lora_adapter`, adapter_sync.py), never named on
the command line, so that adding or removing one changes nothing in the pod template and rolls
no pod. The template depends only on whether there are adapters at all (`--max-loras` turns the
engine's slots on; CUDA graphs are off while they are) and on the set of PersistentVolumeClaims
pvc:// adapters live on (each is mounted read-only; an adapter on a claim not mounted yet rolls
the pods once). A pvc:// adapter on the model's own claim uses the model's mount.

hf:// and s3:// adapters are fetched by the engine container when it loads them: their URI is the
`lora_path` the operator sends, with the model's credentials and endpoint in the engine's
environment (read from the Secret by the kubelet). A download that fails fails that load only
(a 400 with the reason): the base keeps serving, and the operator reports the adapter
(condition AdaptersReady, a Warning Event).

A new pod (a scale-up, a rollout) must not take requests before it holds spec.adapters, or it
answers 404 for them until the loop's next round: with adapters, the pod has a readiness gate
(ADAPTERS_GATE) that the adapter loop sets once every adapter is loaded on it or has failed (the
failure reported; the base serves). Until then the pod is not Ready: no Service endpoint, no
router traffic, and a rollout does not take an old pod down for it. Loading at run time, not on
the command line, keeps an adapter change from rolling the pods. A multi-node group's workers
serve no API and carry no gate (leaderworkerset.py).

Changing adapters at run time administers the engine, so clients must not (issue 48): with
adapters, the engine runs with --enable-runtime-lora and an admin key (KAON_ADMIN_KEY) that only
the operator knows, from a Secret per InferenceService (`<name>-admin-key`, random, made once by
the reconciler and owned by the service; the adapter loop reads it only while the service owns
it). The serving keys of spec.auth do not open the adapter routes, and the router never forwards
them.
"""
from __future__ import annotations

from kaon_operator import api

ADAPTER_MOUNT = "/mnt/adapters"  # pvc:// adapters' claims, one folder per claim, read-only
MODEL_MOUNT = api.OWN_VOLUMES["model"]
MODEL_CACHE_DIR = f"{api.OWN_VOLUMES['cache']}/models"
CREDENTIAL_KEYS = ("HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")


def _pvc(uri: str) -> tuple[str, str]:
    claim, _, sub = uri[len("pvc://"):].partition("/")
    return claim, sub.strip("/")


def _model_claim(spec: api.InferenceServiceSpec) -> str | None:
    return _pvc(spec.model.uri)[0] if spec.model.uri.startswith("pvc://") else None


def adapter_claims(spec: api.InferenceServiceSpec) -> list[str]:
    """The claims pvc:// adapters live on, besides the model's own (sorted: a stable template)."""
    claims = {_pvc(a.uri)[0] for a in spec.adapters if a.uri.startswith("pvc://")}
    return sorted(claims - {_model_claim(spec)})


def _volume_name(index: int) -> str:
    return f"kaon-adapters-{index}"


def lora_path(spec: api.InferenceServiceSpec, adapter: api.AdapterSpec) -> str:
    """The `lora_path` the engine is given: the adapter's folder in the pod (pvc://), else its URI,
    which the engine fetches into the model cache."""
    if not adapter.uri.startswith("pvc://"):
        return adapter.uri
    claim, sub = _pvc(adapter.uri)
    root = MODEL_MOUNT if claim == _model_claim(spec) else f"{ADAPTER_MOUNT}/{claim}"
    return f"{root}/{sub}" if sub else root


ADAPTERS_GATE = "kaon.dev/adapters-loaded"


def readiness_gates(spec: api.InferenceServiceSpec) -> list[dict]:
    """The pod's readiness gates: ADAPTERS_GATE when it serves adapters."""
    return [{"conditionType": ADAPTERS_GATE}] if spec.adapters else []


ADMIN_KEY_ENV, ADMIN_KEY_FIELD = "KAON_ADMIN_KEY", "key"


def admin_secret_name(name: str) -> str:
    return f"{name}-admin-key"


def admin_key_secret(metadata: dict, name: str, key: str) -> dict:
    """The Secret of the service `name`'s admin key `key` (random, from the reconciler)."""
    return {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {**metadata, "name": admin_secret_name(name)}, "stringData": {ADMIN_KEY_FIELD: key}}


def engine_args(spec: api.InferenceServiceSpec) -> list[str]:
    if not spec.adapters:
        return []
    # Registered adapters are bounded by spec.adapters' own bound, not by the slots: the template
    # must not change with the number of adapters (that would roll the pods).
    return ["--max-loras", str(spec.engine.max_loras), "--max-lora-rank", str(spec.engine.max_lora_rank),
            "--enable-runtime-lora", "--max-cpu-loras", str(api.MAX_ADAPTERS)]


def admin_env(spec: api.InferenceServiceSpec, name: str) -> list[dict]:
    """The engine's admin key, from the service's own Secret (after the spec's env: it cannot be replaced); the
    standby loop sends it too (autoscaling/standby.py)."""
    if not spec.adapters and not (spec.autoscaling.enabled and spec.autoscaling.standby):
        return []
    return [{"name": ADMIN_KEY_ENV, "valueFrom": {"secretKeyRef": {"name": admin_secret_name(name),
                                                                   "key": ADMIN_KEY_FIELD}}}]


def volumes(spec: api.InferenceServiceSpec) -> tuple[list[dict], list[dict]]:
    """The pod volumes and the engine's mounts of the adapters' claims."""
    claims = adapter_claims(spec)
    return ([{"name": _volume_name(i), "persistentVolumeClaim": {"claimName": c, "readOnly": True}}
             for i, c in enumerate(claims)],
            [{"name": _volume_name(i), "mountPath": f"{ADAPTER_MOUNT}/{c}", "readOnly": True}
             for i, c in enumerate(claims)])


def engine_env(spec: api.InferenceServiceSpec) -> list[dict]:
    """Where the engine fetches hf:// and s3:// adapters to, and with which credentials: the model's."""
    if not spec.adapters:
        return []
    model = spec.model
    env: list[dict] = [{"name": "KAON_MODEL_CACHE", "value": MODEL_CACHE_DIR}]
    if model.credentials_secret:
        env += [{"name": key, "valueFrom": {"secretKeyRef": {"name": model.credentials_secret, "key": key,
                                                             "optional": True}}} for key in CREDENTIAL_KEYS]
    if model.endpoint:  # the model's source decides which kind of endpoint it is
        env.append({"name": "HF_ENDPOINT" if model.uri.startswith("hf://") else "AWS_ENDPOINT_URL",
                    "value": model.endpoint})
    return env
