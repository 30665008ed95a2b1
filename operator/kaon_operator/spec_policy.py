"""What an InferenceService's pass-through fields may ask for. Whoever may create an
InferenceService must not thereby get any pod they like: the engine pod runs with the
operator's choices, and the fields passed through to it are limited here. Pure: the spec and
the admin's opt-ins in, the reason for a refusal (or None) out; the reconciler reports it as
InvalidSpec and applies nothing.

- volumes: configMap, secret, emptyDir, persistentVolumeClaim and projected only; hostPath
  only when the admin opts in (chart value operator.allowHostPath, `--allow-host-path`).
- extraArgs: none that names (or abbreviates, as argparse accepts) a flag that decides who
  may call the engine or where it listens: `--api-key`, `--api-key-file`, `--host`, `--port`.
- tolerations: none that tolerates every taint (operator Exists without a key) or the control
  plane's taints: engine pods stay off nodes the admin fenced.
- env / envFrom: no Secret (secretKeyRef, secretRef) unless the admin opts in (operator.allowSecretEnv,
  `--allow-secret-env`): the fetch container's credentials come through spec.model.credentialsSecret.
- volumes: no `secret` volume and no `projected` one with a secret or serviceAccountToken source unless
  the admin opts in (operator.allowSecretVolumes, `--allow-secret-volumes`): a tenant who may create an
  InferenceService but not read the namespace's Secrets must not get one into a pod it shapes.
- engine.image: one of the admin's allow-list when there is one (operator.allowedImages,
  `--allowed-image`; empty: any image, as before). Why it matters for Secrets: the Secrets a spec names
  for kaon's own features (spec.auth.apiKeySecret, mounted as files; spec.model.credentialsSecret, in
  the fetch's and, with adapters, the engine's environment; the API key the adapter loop sends) are
  read by the image's code. With the allow-list, that code is one the admin trusts to use them only as
  kaon does; without it, whoever may create an InferenceService may read any Secret it can name
  there (docs/security.md says so).

`checked` is what every reader of a spec goes through (the reconciler, the adapter and autoscale
loops): a refused spec gets no pod, no API key sent to its pods, and no profiling Job.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from kaon_operator import api
from kaon_operator.config import SpecPolicy

VOLUME_SOURCES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected"})
SECURITY_FLAGS = ("--api-key", "--api-key-file", "--host", "--port")
CONTROL_PLANE_TAINTS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"})
CREDENTIAL_PROJECTIONS = frozenset({"secret", "serviceAccountToken"})  # what a projected volume may hold


def checked(body_spec: Mapping[str, Any], policy: SpecPolicy) -> api.InferenceServiceSpec | str:
    """The spec as a model, or why it is invalid or more than the admin allows (one line)."""
    spec = api.parse_spec(body_spec)
    return spec if isinstance(spec, str) else refusal(spec, policy) or spec


def image_allowed(image: str, allowed: Iterable[str]) -> bool:
    """Whether `image` is one of `allowed`: an entry ending in `/` allows every image under that path
    (`registry.example/kaon/`); any other allows that repository at any tag or digest (`ghcr.io/x/kaon`),
    or exactly itself (`ghcr.io/x/kaon:0.1.0`). Never a longer name (`ghcr.io/x/kaon-evil`)."""
    return any(image.startswith(entry) if entry.endswith("/") else
               image == entry or image.startswith((f"{entry}:", f"{entry}@")) for entry in allowed)


def _secret_volume(volume: api.Volume) -> str | None:
    """What Secret (or token) the volume mounts, in words; None when none."""
    source = volume.model_extra or {}
    if "secret" in source:
        return f"Secret {(source['secret'] or {}).get('secretName')}"
    for item in (source.get("projected") or {}).get("sources") or ():
        for kind in CREDENTIAL_PROJECTIONS & set(item or {}):
            return f"Secret {(item[kind] or {}).get('name')}" if kind == "secret" else "a ServiceAccount token"
    return None


def refusal(spec: api.InferenceServiceSpec, policy: SpecPolicy) -> str | None:
    """Why the spec asks for more than the policy allows (naming the field), or None."""
    engine = spec.engine
    if policy.allowed_images and not image_allowed(engine.image, policy.allowed_images):
        return (f"engine.image: {engine.image} is not one this cluster's admin allows (operator.allowedImages: "
                f"{', '.join(policy.allowed_images)})")
    for volume in engine.volumes or ():
        sources = set(volume.model_extra or {})
        allowed = VOLUME_SOURCES | ({"hostPath"} if policy.allow_host_path else set())
        if not sources <= allowed:
            return (f"engine.volumes: {volume.name} uses {', '.join(sorted(sources - allowed))}; allowed: "
                    f"{', '.join(sorted(allowed))}" + ("" if policy.allow_host_path else
                                                       " (hostPath only where the admin allows it)"))
        mounted = None if policy.allow_secret_volumes else _secret_volume(volume)
        if mounted:
            return (f"engine.volumes: {volume.name} mounts {mounted}, which this cluster's admin does not allow "
                    "(operator.allowSecretVolumes); API keys go in spec.auth, model credentials in "
                    "spec.model.credentialsSecret")
    if spec.model.cache.node and not policy.allow_host_path:
        return ("model.cache.node keeps the model on the node through a hostPath, which this cluster's admin does "
                "not allow (operator.allowHostPath)")
    for arg in engine.extra_args:
        name = arg.split("=", 1)[0]
        if len(name) > 2 and name.startswith("--") and any(flag.startswith(name) for flag in SECURITY_FLAGS):
            return (f"engine.extraArgs: {arg!r} sets a flag the operator owns ({', '.join(SECURITY_FLAGS)}): "
                    "use spec.auth for keys")
    for toleration in (spec.scheduling.tolerations if spec.scheduling else None) or ():
        if toleration.get("operator") == "Exists" and not toleration.get("key"):
            return "scheduling.tolerations: a toleration without a key tolerates every taint; name the taint"
        if toleration.get("key") in CONTROL_PLANE_TAINTS:
            return f"scheduling.tolerations: {toleration['key']} puts engine pods on control-plane nodes"
    if not policy.allow_secret_env:
        secret_env = [e.name for e in engine.env or () if "secretKeyRef" in (e.value_from or {})]
        secret_env += [str(ref["secretRef"].get("name")) for ref in engine.env_from or () if "secretRef" in ref]
        if secret_env:
            return (f"engine.env/envFrom: {', '.join(secret_env)} read a Secret, which this cluster's admin does not "
                    "allow (operator.allowSecretEnv); model credentials go in spec.model.credentialsSecret")
    return None
