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
    assert refusal(spec(engine={"volumes": fine}), SpecPolicy()) is None
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
