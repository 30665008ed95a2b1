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
"""
from __future__ import annotations

from kaon_operator import api
from kaon_operator.config import SpecPolicy

VOLUME_SOURCES = frozenset({"configMap", "secret", "emptyDir", "persistentVolumeClaim", "projected"})
SECURITY_FLAGS = ("--api-key", "--api-key-file", "--host", "--port")
CONTROL_PLANE_TAINTS = frozenset({"node-role.kubernetes.io/control-plane", "node-role.kubernetes.io/master"})


def refusal(spec: api.InferenceServiceSpec, policy: SpecPolicy) -> str | None:
    """Why the spec asks for more than the policy allows, or None."""
    engine = spec.engine
    for volume in engine.volumes or ():
        sources = set(volume.model_extra or {})
        allowed = VOLUME_SOURCES | ({"hostPath"} if policy.allow_host_path else set())
        if not sources <= allowed:
            return (f"engine.volumes: {volume.name} uses {', '.join(sorted(sources - allowed))}; allowed: "
                    f"{', '.join(sorted(allowed))}" + ("" if policy.allow_host_path else
                                                       " (hostPath only where the admin allows it)"))
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
