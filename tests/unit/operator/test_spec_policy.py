"""What an InferenceService's pass-through fields may ask for (spec_policy.py): whoever may
create one must not get any pod they like."""
from __future__ import annotations

from kaon_operator import api
from kaon_operator.config import SpecPolicy
from kaon_operator.spec_policy import refusal

MODEL = {"uri": "builtin://smollm2-135m-instruct"}


def spec(**fields) -> api.InferenceServiceSpec:
    parsed = api.parse_spec({"model": MODEL, **fields})
    assert not isinstance(parsed, str), parsed
    return parsed


def test_volume_types_are_an_allow_list_and_host_path_needs_the_admin():
    fine = [{"name": n, src: {}} for n, src in (("a", "configMap"), ("b", "secret"), ("c", "emptyDir"),
                                                 ("d", "persistentVolumeClaim"), ("e", "projected"))]
    assert refusal(spec(engine={"volumes": fine}), SpecPolicy(allow_secret_volumes=True)) is None
    host = spec(engine={"volumes": [{"name": "root", "hostPath": {"path": "/"}}]})
    assert "hostPath" in refusal(host, SpecPolicy())
    assert refusal(host, SpecPolicy(allow_host_path=True)) is None
    assert "nfs" in refusal(spec(engine={"volumes": [{"name": "n", "nfs": {"server": "x", "path": "/"}}]}),
                            SpecPolicy(allow_host_path=True))


def test_extra_args_may_not_set_a_security_flag_even_abbreviated():
    assert refusal(spec(engine={"extraArgs": ["--log-level", "debug", "--max-stop", "4"]}), SpecPolicy()) is None
    for arg in ("--api-key-file=/dev/null", "--api-key", "--api-key-f", "--host", "--port=1", "--ho"):
        assert "flag the operator owns" in refusal(spec(engine={"extraArgs": [arg, "x"]}), SpecPolicy()), arg


def test_tolerations_of_every_taint_or_the_control_plane_are_refused():
    ok = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
    assert refusal(spec(scheduling={"tolerations": [ok]}), SpecPolicy()) is None
    assert "every taint" in refusal(spec(scheduling={"tolerations": [{"operator": "Exists"}]}), SpecPolicy())
    control = {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"}
    assert "control-plane" in refusal(spec(scheduling={"tolerations": [control]}), SpecPolicy())


def test_secrets_in_the_environment_need_the_admin():
    env = spec(engine={"env": [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "db", "key": "k"}}}],
                       "envFrom": [{"configMapRef": {"name": "c"}}]})
    assert "T read a Secret" in refusal(env, SpecPolicy())
    assert "other read a Secret" in refusal(spec(engine={"envFrom": [{"secretRef": {"name": "other"}}]}), SpecPolicy())
    assert refusal(env, SpecPolicy(allow_secret_env=True)) is None
    assert refusal(spec(engine={"envFrom": [{"configMapRef": {"name": "c"}}]}), SpecPolicy()) is None


# A tenant who may create an InferenceService but not read the namespace's Secrets, trying each way
# a pod can be made to read one (issue 48, item 5).
SECRET_VOLUMES = [
    {"name": "plain", "secret": {"secretName": "db-password"}},
    {"name": "proj", "projected": {"sources": [{"configMap": {"name": "ca"}},
                                               {"secret": {"name": "db-password"}}]}},
    {"name": "token", "projected": {"sources": [{"serviceAccountToken": {"path": "t", "audience": "api"}}]}},
]


def test_a_secret_cannot_be_mounted_through_a_secret_or_projected_volume():
    for volume in SECRET_VOLUMES:
        mounted = spec(engine={"volumes": [volume], "volumeMounts": [{"name": volume["name"], "mountPath": "/x"}]})
        why = refusal(mounted, SpecPolicy(allow_secret_env=False))
        assert why is not None and why.startswith(f"engine.volumes: {volume['name']} mounts"), volume
        assert "operator.allowSecretVolumes" in why
        assert refusal(mounted, SpecPolicy(allow_secret_volumes=True)) is None
    harmless = {"name": "ca", "projected": {"sources": [{"configMap": {"name": "ca"}}, {"downwardAPI": {"items": []}}]}}
    assert refusal(spec(engine={"volumes": [harmless]}), SpecPolicy()) is None


def test_the_image_allow_list_names_the_field_and_refuses_lookalikes():
    policy = SpecPolicy(allowed_images=("ghcr.io/kaon-dev/kaon", "registry.example/ml/"))
    for image in ("ghcr.io/kaon-dev/kaon", "ghcr.io/kaon-dev/kaon:0.2.0", "ghcr.io/kaon-dev/kaon@sha256:ab",
                  "registry.example/ml/kaon:1"):
        assert refusal(spec(engine={"image": image}), policy) is None, image
    for image in ("attacker.example/exfil:latest", "ghcr.io/kaon-dev/kaon-evil:1", "ghcr.io/kaon-dev/kaonx",
                  "registry.example/mlx/kaon:1"):
        why = refusal(spec(engine={"image": image}), policy)
        assert why is not None and why.startswith(f"engine.image: {image} ") and "allowedImages" in why, image
    # A spec naming a Secret for kaon's own features with a free image: refused with the list set ...
    keyed = spec(engine={"image": "attacker.example/exfil:latest"}, auth={"apiKeySecret": "db-password"})
    assert refusal(keyed, policy).startswith("engine.image:")
    # ... and, as before, allowed when the admin sets none (existing installs keep working).
    assert refusal(keyed, SpecPolicy()) is None
    assert refusal(spec(), SpecPolicy(allowed_images=(api.DEFAULT_IMAGE,))) is None


def test_checked_parses_then_applies_the_policy():
    from kaon_operator.spec_policy import checked
    assert isinstance(checked({"model": MODEL}, SpecPolicy()), api.InferenceServiceSpec)
    assert checked({"model": MODEL, "engine": {"volumes": [SECRET_VOLUMES[1]]}}, SpecPolicy()).startswith(
        "engine.volumes: proj mounts Secret db-password")
    assert "model" in checked({}, SpecPolicy())
