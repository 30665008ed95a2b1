"""spec.prefill on the local cluster (e2e/local_cluster.py), as a cluster admin would try it: the operator runs
the prefill pool beside the decode pool, both real `kaon serve` processes (the pod runner playing the kubelet,
and kube-proxy for the decode engines' `--prefill-url http://<name>-prefill:80`: e2e/service_proxy.py); a long
prompt sent through kaon's router is prefilled on the prefill pod and decoded on the decode pod, its greedy
tokens equal to an aggregated engine's (the prefill engine's own /v1); the PREFILL column counts the pool; and a
prefill engine killed costs no request: the decode engine prefills it itself and counts the fallback
(docs/disaggregation.md)."""
from __future__ import annotations

import httpx
from openai import OpenAI

from e2e.local_cluster import LOCAL_IMAGE
from kaon_operator import labels
from support.cluster import Cluster, isvc, wait_for

SPEC = {"model": {"uri": "builtin://smollm2-135m-instruct", "servedName": "smollm2"},
        "engine": {"image": LOCAL_IMAGE, "maxNumSeqs": 2},
        "replicas": 1,
        "prefill": {"replicas": 1, "minPromptTokens": 32, "timeoutSeconds": 60}}
LONG = "Kubernetes schedules pods onto nodes; the kubelet starts their containers. " * 12  # ~170 tokens
OTHER = "A different long prompt about the sea and its tides, waves and currents. " * 10  # no prefix in common
ENGINE_PORT = 8000  # the pod template's HTTP port


def _metric(url: str, line_start: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[1])
    raise KeyError(line_start)


def _fallbacks(url: str) -> float:
    return sum(_metric(url, f'kaon_kv_transfer_fallbacks_total{{reason="{r}"}}')
               for r in ("unreachable", "timeout", "garbage", "refused", "evicted", "busy"))


def test_a_prefill_pool_prefills_through_the_router_and_a_killed_prefill_engine_costs_no_request(
        local, crd, namespace):
    cluster = Cluster(crd, namespace)
    cluster.kubectl("apply", "-f", "-", input=isvc("pd", **SPEC))
    wait_for("both pools ready, each a real engine", lambda: cluster.ready("pd") and cluster.status("pd").get(
        "prefillReadyReplicas") == 1, timeout=300)
    header, row = cluster.kubectl("get", "infsvc", "pd", "-o", "wide").stdout.splitlines()[:2]
    assert dict(zip(header.split(), row.split()))["PREFILL"] == "1", (header, row)

    def pod_url(component: str) -> str:
        [pod] = [p for p in cluster.running_pods("pd") if p["metadata"]["labels"][labels.COMPONENT] == component]
        return f"http://{pod['status']['podIP']}:{ENGINE_PORT}"
    decode, prefill = pod_url(labels.ENGINE), pod_url(labels.PREFILL)

    client = OpenAI(base_url=f"{local.router_url}/v1", api_key="unused", timeout=300, max_retries=0)
    split = client.completions.create(model="smollm2", prompt=LONG, max_tokens=8, temperature=0, logprobs=0)
    received = _metric(decode, 'kaon_kv_transfer_tokens_total{direction="received"}')
    assert received == split.usage.prompt_tokens - 1, received  # all but the last token, which the decode step takes
    assert _metric(prefill, 'kaon_kv_transfer_tokens_total{direction="sent"}') == received
    assert _fallbacks(decode) == 0
    # The prefill engine also serves /v1 as an ordinary engine: the aggregated reference.
    aggregated = OpenAI(base_url=f"{prefill}/v1", api_key="unused", timeout=300, max_retries=0)

    def tokens(answer) -> list[str]:
        return answer.choices[0].logprobs.tokens
    reference = {prompt: tokens(aggregated.completions.create(model="smollm2", prompt=prompt, max_tokens=8,
                                                              temperature=0, logprobs=0)) for prompt in (LONG, OTHER)}
    assert tokens(split) == reference[LONG]

    # The prefill engine dies: the next long prompt is prefilled on the decode engine, and answers the same.
    [key] = [k for k in local.pods.processes if k.startswith(f"{namespace}/pd-prefill-")]
    local.pods.processes[key].proc.kill()
    again = client.completions.create(model="smollm2", prompt=OTHER, max_tokens=8, temperature=0, logprobs=0)
    assert tokens(again) == reference[OTHER]
    assert _fallbacks(decode) == 1
