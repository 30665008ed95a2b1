"""spec.engine.maxNumSeqs / maxNumBatchedTokens left unset reach no pod as a flag, so every engine runs its own
default: the one for its device (--max-num-seqs 8 on a CPU, 64 on a GPU) and its role (a decode pod's 256-token
steps); what the user sets is passed as it is. The rendered command lines are parsed by `kaon serve`'s own parser
here, so the test fails if the operator pins a value the engine would otherwise choose (as it did: 64 and 1024 to
every pod, the CRD's defaults), and if the engine's defaults stop being what the docs promise."""
from __future__ import annotations

from kaon_operator import api
from kaon_operator.children import resources as r
from kaon_operator.config import NetworkPolicyConfig
from kaon_operator.router.endpoints import service
from kaon_runtime.cli import build_parser, engine_config

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000001")
NETWORK = NetworkPolicyConfig(release_namespace="kaon-system")


def spec(**overrides) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"}, **overrides})


def pod_args(s: api.InferenceServiceSpec) -> dict[str, list[str]]:
    """Each Deployment's engine command line, by the Deployment's name."""
    return {c["metadata"]["name"]: c["spec"]["template"]["spec"]["containers"][0]["args"]
            for c in r.render(OWNER, s, NETWORK) if c["kind"] == "Deployment"}


def served(args: list[str], device: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) of the engine that command line starts on `device`."""
    assert args[:2] == ["kaon", "serve"]
    config = engine_config(build_parser().parse_args([*args[1:], "--device", device]))
    return config.max_num_seqs, config.max_num_batched_tokens


def test_unset_batch_limits_leave_each_engine_its_own_default():
    plain = pod_args(spec())["llama"]
    assert "--max-num-seqs" not in plain and "--max-num-batched-tokens" not in plain
    assert served(plain, "cpu") == (8, 1024)
    assert served(plain, "cuda") == (64, 1024)
    disagg = pod_args(spec(prefill={"replicas": 1}))
    assert served(disagg["llama"], "cpu") == (8, 256)  # the decode pods: short steps their streams wait on
    assert served(disagg["llama-prefill"], "cuda") == (64, 1024)


def test_a_users_batch_limits_reach_every_pod():
    chosen = spec(engine={"maxNumSeqs": 64, "maxNumBatchedTokens": 2048}, prefill={"replicas": 1})
    for args in pod_args(chosen).values():
        assert served(args, "cpu") == (64, 2048)
    only_seqs = pod_args(spec(engine={"maxNumSeqs": 3}, prefill={"replicas": 1}))
    assert served(only_seqs["llama"], "cpu") == (3, 256)


def test_the_operators_sums_count_a_gpu_engines_default_or_the_measured_or_the_set_value():
    assert api.EngineSpec().batch_slots() == api.ENGINE_GPU_MAX_NUM_SEQS == served(pod_args(spec())["llama"], "cuda")[0]
    assert api.EngineSpec().batch_slots(measured=8) == 8  # a profile of a CPU engine
    assert api.EngineSpec(max_num_seqs=4).batch_slots(measured=8) == 4
    isvc = {"metadata": {"namespace": "serving", "name": "llama"}, "spec": {"model": {"uri": "builtin://x"}}}
    assert service(isvc).max_num_seqs == api.ENGINE_GPU_MAX_NUM_SEQS
