"""LoRA adapters through the router: `model` may name `<adapter>` or `<namespace>/<adapter>` (the
tenancy rules of served names), the engine gets the adapter's name, and adapter affinity
(router/strategies/adapter_affinity.py) keeps >= 90% of an adapter's requests on pods that hold
it in a slot, under the load bound, in a fleet with more adapters than slots per pod."""
from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from kaon_operator.router.endpoints import Endpoint, EndpointTable, ServiceKey, service
from kaon_operator.router.request import engine_body
from kaon_operator.router.strategies import Attempt, Strategies
from kaon_operator.router.strategies.prefix_affinity import BOUND_SLACK, capacity

NS = "team"


def isvc(name: str, namespace: str = NS, adapters=(), created: str = "2026-01-01T00:00:00Z", **spec) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "creationTimestamp": created},
            "spec": {"model": {"uri": "hf://org/base"}, "adapters": [{"name": a, "uri": f"hf://org/{a}"}
                                                                     for a in adapters], **spec}}


def table(*services, cluster_wide: bool = False) -> EndpointTable:
    t = EndpointTable(default_namespace=NS, cluster_wide_names=cluster_wide)
    t.replace_services(None, services)
    return t


def test_an_adapter_resolves_to_its_service_under_the_tenancy_rules():
    t = table(isvc("llama", adapters=["sql", "chat"]), isvc("qwen", "other", adapters=["legal"]))
    assert t.resolve("sql") == t.resolve("team/sql") == ServiceKey(NS, "llama")
    assert t.resolve("other/legal") == ServiceKey("other", "qwen")
    assert t.resolve("legal") is None  # another namespace's, and names are not cluster-wide
    assert t.resolve("team/legal") is None and t.resolve("other/sql") is None
    assert table(isvc("qwen", "other", adapters=["legal"]), cluster_wide=True).resolve("legal") == ServiceKey(
        "other", "qwen")
    # a served name wins over an adapter of the same name
    assert table(isvc("llama", adapters=["qwen"]), isvc("qwen")).resolve("qwen") == ServiceKey(NS, "qwen")


def test_the_models_listing_names_the_adapters_after_the_services():
    t = table(isvc("llama", adapters=["sql", "qwen"]), isvc("qwen"), isvc("mistral", "other", adapters=["legal"]))
    assert [(name, s.key.name) for name, s in t.addressable()] == [
        ("llama", "llama"), ("other/mistral", "mistral"), ("qwen", "qwen"), ("other/legal", "mistral"),
        ("sql", "llama")]  # the adapter `qwen` is shadowed by the served name


def test_the_engine_gets_the_adapters_own_name():
    t = table(isvc("llama", adapters=["sql"]))
    svc = t.service(ServiceKey(NS, "llama"))
    assert svc is not None
    assert t.engine_model("team/sql", svc) == t.engine_model("sql", svc) == "sql"
    assert t.engine_model("team/llama", svc) == t.engine_model("llama", svc) == "llama"
    payload = {"model": "team/sql", "prompt": "x"}
    assert engine_body(b"", payload, "team/sql", t.engine_model("team/sql", svc)) == b'{"model": "sql", "prompt": "x"}'


def test_an_invalid_adapter_entry_is_not_routed():
    svc = service({"metadata": {"name": "s", "namespace": NS},
                   "spec": {"model": {"uri": "x"}, "adapters": [{"name": "ok", "uri": "hf://o/ok"},
                                                                {"name": "bad", "uri": "/abs"}]}})
    assert svc.adapters == ("ok",)


# The simulated fleet -------------------------------------------------------------------------------------------


class EngineSlots:
    """An engine's adapter slots: LRU, as the engine's pool evicts."""

    def __init__(self, size: int):
        self.size, self.held = size, OrderedDict[str, None]()

    def use(self, adapter: str) -> bool:
        """Whether it was held already (no load), then it is the most recently used."""
        hit = adapter in self.held
        self.held.pop(adapter, None)
        self.held[adapter] = None
        while len(self.held) > self.size:
            self.held.popitem(last=False)
        return hit


def simulate(affinity: bool, *, pods: int = 4, slots: int = 4, adapters: int = 12, requests: int = 4000,
             mean_inflight: float = 12.0, seed: int = 0) -> tuple[float, int]:
    """(share of adapter requests that found their adapter in the pod's slots, how many picks broke
    prefix affinity's load bound: a pod taking a request at ceil(loadBound x mean) requests in flight and
    more than BOUND_SLACK above the least loaded pod). Requests arrive one at a time with a random
    adapter (popularity skewed 1/rank); each request in flight finishes with a probability that keeps
    about `mean_inflight` of them in flight."""
    rng = random.Random(seed)
    spec = isvc("llama", adapters=[f"a{i}" for i in range(adapters)], engine={"maxLoras": slots},
                routing={"strategy": "least-connections"})
    svc = service(spec)
    fleet = tuple(Endpoint(NS, f"pod-{i}", "llama", f"http://10.0.0.{i}:8000") for i in range(pods))
    engines = {e: EngineSlots(slots) for e in fleet}
    strategies = Strategies()
    inflight: dict[Endpoint, int] = dict.fromkeys(fleet, 0)
    running: list[Endpoint] = []
    weights = [1 / (rank + 1) for rank in range(adapters)]
    hits = over_bound = 0
    for _ in range(requests):
        for e in list(running):  # each finishes with p = 1 / mean_inflight
            if rng.random() < 1 / mean_inflight:
                running.remove(e)
                inflight[e] -= 1
        adapter = rng.choices(svc.adapters, weights)[0]
        payload = {"model": adapter if affinity else "llama", "prompt": "hi"}
        attempt = Attempt(svc, fleet, fleet, inflight, "/v1/completions", payload, 0.0, rng)
        target = strategies.get(svc.strategy).pick(attempt).target
        limit = max(capacity(inflight, fleet, svc.load_bound), min(inflight.values()) + BOUND_SLACK + 1)
        over_bound += inflight[target] >= limit
        hits += engines[target].use(adapter)
        inflight[target] += 1
        running.append(target)
    return hits / requests, over_bound


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_adapter_requests_land_on_pods_holding_their_adapter_under_the_load_bound(seed):
    share, over_bound = simulate(True, seed=seed)
    without, _ = simulate(False, seed=seed)  # the same fleet, least connections only
    assert share >= 0.90, (share, without)
    assert without < 0.6, without  # 12 adapters over 4 slots per pod thrash without affinity
    assert over_bound == 0  # the affinity never outweighs the load bound

