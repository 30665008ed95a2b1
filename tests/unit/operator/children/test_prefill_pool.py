"""spec.prefill (prefill/decode disaggregation): the prefill pool's children, the decode pods' flags, the
validation, and the pool's status (docs/disaggregation.md)."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kaon_operator import api
from kaon_operator.children import prefill_pool, resources as r
from kaon_operator.config import NetworkPolicyConfig
from kaon_operator.status import conditions, prefill_status
from kaon_operator.status.summaries import DeploymentSummary

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000001")
NETWORK = NetworkPolicyConfig(release_namespace="kaon-system")


def spec(**overrides) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({"model": {"uri": "builtin://smollm2-135m-instruct"}, **overrides})


def by_name(children: list[dict]) -> dict[tuple[str, str], dict]:
    return {(c["kind"], c["metadata"]["name"]): c for c in children}


def args(deployment: dict) -> list[str]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["args"]


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


DISAGG = spec(prefill={"replicas": 3, "minPromptTokens": 512, "resources": {"requests": {"cpu": "6"}}},
              resources={"requests": {"cpu": "2"}}, replicas=2,
              adapters=[{"name": "sql", "uri": "hf://org/sql-lora"}])


def test_without_prefill_nothing_changes():
    children = r.render(OWNER, spec(), NETWORK)
    assert [c["metadata"]["name"] for c in children] == ["llama"] * 4
    assert "--role" not in args(children[0])


def test_prefill_pool_is_a_second_deployment_behind_its_own_service():
    children = by_name(r.render(OWNER, DISAGG, NETWORK))
    assert set(children) == {("Deployment", "llama"), ("Service", "llama"), ("PodDisruptionBudget", "llama"),
                             ("NetworkPolicy", "llama"), ("Deployment", "llama-prefill"),
                             ("Service", "llama-prefill"), ("NetworkPolicy", "llama-prefill")}
    pool = children[("Deployment", "llama-prefill")]
    assert pool["spec"]["replicas"] == 3 and children[("Deployment", "llama")]["spec"]["replicas"] == 2
    pool_labels = {"app.kubernetes.io/name": "kaon", "app.kubernetes.io/instance": "llama",
                   "app.kubernetes.io/component": "prefill", "kaon.dev/inferenceservice": "llama"}
    assert pool["metadata"]["labels"] == pool["spec"]["template"]["metadata"]["labels"] == pool_labels
    selector = {"kaon.dev/inferenceservice": "llama", "app.kubernetes.io/component": "prefill"}
    assert pool["spec"]["selector"]["matchLabels"] == selector
    assert children[("Service", "llama-prefill")]["spec"]["selector"] == selector
    # Neither the engine Service (the router's way in) nor the engine selector picks the prefill pods.
    assert children[("Service", "llama")]["spec"]["selector"]["app.kubernetes.io/component"] == "engine"
    for child in (pool, children[("Service", "llama-prefill")]):
        assert child["metadata"]["ownerReferences"][0]["uid"] == OWNER.uid
    (container,) = pool["spec"]["template"]["spec"]["containers"]
    assert container["resources"]["requests"]["cpu"] == "6"  # the pool's own resources
    assert flag(args(pool), "--role") == "prefill" and "--prefill-url" not in args(pool)
    # spec.adapters on the prefill pods too (a LoRA prompt's K/V is computed there with its adapter): loadable at
    # run time by the adapter loop, and Ready only once they hold them, as the decode pods
    assert "--enable-runtime-lora" in args(pool) and "--enable-runtime-lora" in args(children[("Deployment", "llama")])
    assert pool["spec"]["template"]["spec"]["readinessGates"] == [{"conditionType": "kaon.dev/adapters-loaded"}]


def test_decode_pods_point_at_the_prefill_service():
    decode = args(r.deployment(OWNER, DISAGG))
    assert flag(decode, "--role") == "decode"
    assert flag(decode, "--prefill-url") == "http://llama-prefill:80"
    assert flag(decode, "--disagg-min-prompt-tokens") == "512" and flag(decode, "--disagg-timeout") == "30"
    # no pool to point at: an ordinary engine
    assert "--role" not in args(r.deployment(OWNER, spec(prefill={"replicas": 0})))


def test_prefill_pods_take_connections_from_this_services_decode_pods_only():
    policy = by_name(r.render(OWNER, DISAGG, NETWORK))[("NetworkPolicy", "llama-prefill")]["spec"]
    assert policy["podSelector"]["matchLabels"]["app.kubernetes.io/component"] == "prefill"
    (rule,) = policy["ingress"]
    peers = rule["from"]
    assert {"podSelector": {"matchLabels": {"kaon.dev/inferenceservice": "llama",
                                            "app.kubernetes.io/component": "engine"}}} in peers
    assert not any("router" in str(p) for p in peers)  # the router never talks to prefill pods
    assert rule["ports"] == [{"protocol": "TCP", "port": 8000}]
    assert prefill_pool.render(OWNER.name, OWNER.namespace, {}, DISAGG, None)[0]["kind"] == "Deployment"


@pytest.mark.parametrize("engine", [{"tensorParallelSize": 2}, {"nodesPerReplica": 2, "pipelineParallelSize": 2},
                                    {"task": "embed"}])
def test_prefill_needs_one_process_per_engine(engine):
    with pytest.raises(ValidationError, match="prefill"):
        spec(prefill={}, engine=engine)


def test_the_crd_states_the_same_rule():
    rules = api.InferenceServiceSpec.model_json_schema()["x-kubernetes-validations"]
    assert any("prefill" in rule["rule"] and "tensorParallelSize" in rule["rule"] for rule in rules)


def summary(ready: int, replicas: int = 2, failure: str | None = None) -> DeploymentSummary:
    return DeploymentSummary(1, 1, replicas, replicas, replicas, ready, ready, replica_failure=failure)


def test_prefill_condition_counts_and_events():
    assert prefill_status.condition(None, 2)["reason"] == "PrefillPending"
    waiting = prefill_status.condition(summary(1), 2)
    assert waiting["status"] == "False" and "1/2" in waiting["message"]
    ready = prefill_status.condition(summary(2), 2)
    assert ready["status"] == "True" and ready["reason"] == "PrefillPoolReady"
    assert prefill_status.condition(summary(0, failure="exceeded quota"), 2)["message"] == "exceeded quota"
    assert prefill_status.condition(None, 0)["status"] == "True"
    assert prefill_status.counts(summary(1)) == {"prefillReplicas": 2, "prefillReadyReplicas": 1}
    (event,) = conditions.transition_events([ready], [waiting])
    assert (event.type, event.reason) == ("Normal", "PrefillReady")
    (event,) = conditions.transition_events([waiting], [ready])
    assert (event.type, event.reason) == ("Warning", "PrefillNotReady")
    assert conditions.transition_events([ready], [ready]) == []


def test_the_status_a_prefill_pool_gets_is_one_the_apiserver_accepts():
    """The status subresource is validated against the CRD's schema, built from api_status: a condition type the
    schema does not list makes the apiserver refuse the whole status patch (422), so a service with spec.prefill
    got no status at all (no Ready, no PREFILL column), as the local cluster showed. Every PrefillReady the
    operator writes, with the pool's counts, must validate."""
    from kaon_operator import api_status

    for deployment, desired in ((None, 2), (summary(1), 2), (summary(2), 2), (summary(0, failure="quota"), 2),
                                (None, 0)):
        written = {"conditions": [{**prefill_status.condition(deployment, desired),
                                   "lastTransitionTime": "2026-12-01T00:00:00Z"}],
                   **prefill_status.counts(deployment)}
        api_status.InferenceServiceStatus.model_validate(written)
