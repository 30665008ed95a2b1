"""Adapter affinity: a request for a LoRA adapter goes to a pod that holds the adapter in one of
its slots (spec.engine.maxLoras), so that a fleet with more adapters than slots per pod does not
swap adapters in and out on every request. It wraps the service's own strategy, which keeps the
requests for the base model.

The router cannot see the engines' slots, so it models them: each pod's slots as an LRU of the
adapters this router sent there (`Slots`), the engine's own policy (it evicts the least recently
used adapter no running request uses). The choice is prefix affinity's `choose`, under the same
load bound (spec.routing.loadBound, the free-sequence-slot rule):
1. the least loaded pod whose modelled slots hold the adapter;
2. else (no pod holds it: a new or long-unused adapter) the ring owner of the adapter's name, so
   that router replicas agree, while it is within NEW_PREFIX_SLACK of the least loaded pod in
   requests in flight and in adapters held (`homes`), else the least loaded pod (fewest adapters
   on ties), which then holds it;
3. and a holder that carries too much load is passed over the same way: a hot adapter gets
   a second pod instead of piling onto one.
"""
from __future__ import annotations

from collections import OrderedDict

from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.strategies import least_connections
from kaon_operator.router.strategies.base import Attempt, Choice, Strategy
from kaon_operator.router.strategies.prefix_affinity import choose
from kaon_operator.router.strategies.prefixes import stable_hash
from kaon_operator.router.strategies.ring import Rings


class Slots:
    """One pod's adapter slots as this router fills them: the `size` adapters it sent there last."""

    def __init__(self, size: int):
        self.size = size
        self._held: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, adapter: str) -> bool:
        return adapter in self._held

    def __len__(self) -> int:
        return len(self._held)

    def use(self, adapter: str) -> None:
        self._held.pop(adapter, None)
        self._held[adapter] = None
        while len(self._held) > self.size:
            self._held.popitem(last=False)


class AdapterAffinity:
    """Adapter requests by affinity; every other request by `inner` (the service's strategy)."""

    def __init__(self, inner: Strategy):
        self.inner = inner
        self.slots: dict[ServiceKey, dict[Endpoint, Slots]] = {}
        self.rings: Rings[ServiceKey, Endpoint] = Rings(name=lambda e: e.pod)

    def pick(self, attempt: Attempt) -> Choice:
        service, usable, inflight, rng = attempt.service, attempt.usable, attempt.inflight, attempt.rng
        adapter = service.adapter_of(attempt.payload.get("model"))
        if adapter is None:
            return self.inner.pick(attempt)
        slots = self._slots(service.key, attempt.ready, service.max_loras)
        ring = self.rings.of(service.key, attempt.ready)
        order = [e for e in ring.walk(stable_hash(adapter.encode())) if e in usable]
        holding = [e for e in order if adapter in slots[e]]
        first = least_connections.pick(holding, inflight, rng) if holding else None
        target, hit = choose(order, usable, inflight, service.load_bound, first, service.max_num_seqs,
                             {e: len(slots[e]) for e in usable}, rng=rng)
        slots[target].use(adapter)
        return Choice(target, hit)

    def _slots(self, key: ServiceKey, ready: tuple[Endpoint, ...], size: int) -> dict[Endpoint, Slots]:
        known = self.slots.setdefault(key, {})
        for gone in [e for e in known if e not in ready]:
            del known[gone]
        for e in ready:
            if e not in known or known[e].size != size:
                known[e] = Slots(size)
        return known

    def forget(self, key: ServiceKey) -> None:
        self.slots.pop(key, None)
        self.rings.forget(key)
        self.inner.forget(key)
