"""Issue 53 part 4: spec.model.cache.node prefetches the model to the nodes' cache (children/node_prefetch.py):
a DaemonSet whose pod is the engine pod's own `kaon fetch`, on the nodes the engine pods may use."""
from __future__ import annotations

from kaon_operator import api, labels
from kaon_operator.children import node_prefetch, pod_template, resources as r

OWNER = r.Owner(name="llama", namespace="serving", uid="0b7c5b4e-1111-4a2b-9c3d-000000000002")
NODE_AFFINITY = {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "gpu.kind", "operator": "In", "values": ["h100"]}]}]}}


def spec(uri: str = "hf://org/model", node: bool = True, **extra) -> api.InferenceServiceSpec:
    return api.InferenceServiceSpec.model_validate({"model": {"uri": uri, "cache": {"node": node}}, **extra})


def prefetch(s: api.InferenceServiceSpec) -> list[dict]:
    return [c for c in r.render(OWNER, s) if c["kind"] == "DaemonSet"]


def test_a_fetched_model_on_the_node_cache_gets_a_daemonset_running_the_engine_pods_own_fetch():
    s = spec(scheduling={"nodeSelector": {"pool": "gpu"}, "tolerations": [{"key": "team", "operator": "Exists"}],
                         "affinity": {"nodeAffinity": NODE_AFFINITY, "podAntiAffinity": {"x": 1}}},
             engine={"image": "registry.example/kaon:1"})
    [ds] = prefetch(s)
    assert ds["metadata"]["name"] == "llama-prefetch" and ds["metadata"]["namespace"] == "serving"
    assert ds["metadata"]["ownerReferences"] == [r.owner_reference(OWNER)]  # deleted with the service
    pod = ds["spec"]["template"]["spec"]
    engine_pod = r.deployment(OWNER, s)["spec"]["template"]["spec"]
    # The same fetch, credentials and cache folder (hostPath + the namespace's subPathExpr) as the engine pod.
    assert pod["initContainers"] == engine_pod["initContainers"]
    assert pod["initContainers"][0]["args"][:4] == ["kaon", "fetch", "--model", "hf://org/model"]
    cache = next(v for v in pod["volumes"] if v["name"] == "cache")
    assert cache["hostPath"]["path"] == pod_template.NODE_CACHE_ROOT
    # On the nodes the engine pods may use, and no further: selector, tolerations, node affinity only.
    assert pod["nodeSelector"] == {"pool": "gpu"} and pod["tolerations"] == engine_pod["tolerations"]
    assert pod["affinity"] == {"nodeAffinity": NODE_AFFINITY}
    # Then it only waits: no GPU, no port, nothing that selects engine pods selects it.
    [hold] = pod["containers"]
    assert hold["image"] == "registry.example/kaon:1" and "nvidia.com/gpu" not in str(hold["resources"])
    template_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= template_labels.items()
    assert not labels.engine_selector("llama").items() <= template_labels.items()


def test_a_model_change_changes_the_template_so_the_daemonset_fetches_again():
    [before] = prefetch(spec("hf://org/model"))
    [after] = prefetch(spec("hf://org/model-v2"))
    assert before["spec"]["template"] != after["spec"]["template"]
    assert after["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1  # node by node


def test_no_prefetch_without_the_node_cache_or_for_a_model_that_is_not_fetched():
    assert not prefetch(spec(node=False))
    assert not prefetch(spec("builtin://smollm2-135m-instruct"))
    assert not prefetch(spec("pvc://models/llama", node=False))
    assert node_prefetch.needed(spec("s3://bucket/model"))


def test_switching_the_node_cache_off_drops_the_daemonset_and_nothing_else_does():
    on, off = spec(), spec(node=False)
    assert node_prefetch.dropped(off, on) and node_prefetch.dropped(spec("builtin://smollm2-135m-instruct"), on)
    assert not node_prefetch.dropped(on, on) and not node_prefetch.dropped(spec("hf://org/other"), on)
    assert not node_prefetch.dropped(off, off) and not node_prefetch.dropped(off, None)
    assert not node_prefetch.dropped(off, "an invalid old spec")


def test_the_node_cache_is_bounded_by_size_limit_through_kaon_fetch():
    """With cache.node, `kaon fetch` (the engine pod's init container and the prefetch pod's) removes the least
    recently used models no pod uses past model.cache.sizeLimit (runtime fetch/evict.py); an emptyDir is not swept."""
    def fetch_args(s: api.InferenceServiceSpec) -> list[str]:
        return r.deployment(OWNER, s)["spec"]["template"]["spec"]["initContainers"][0]["args"]
    bounded = fetch_args(api.InferenceServiceSpec.model_validate(
        {"model": {"uri": "hf://org/model", "cache": {"node": True, "sizeLimit": "500Gi"}}}))
    assert bounded[bounded.index("--cache-limit") + 1] == "500Gi"
    assert "--cache-limit" not in fetch_args(spec(node=False))
