"""Routing strategies, by the names spec.routing.strategy gives them (api.RoutingSpec).

Each is a class with one `pick(attempt) -> Choice`, made once per router (prefix-affinity's
records outlive requests):

    least_connections.py  the pod with the fewest requests in flight
    prefix_affinity.py    the pod that caches the prompt's prefix, within a load bound
    kv_aware.py           the pod whose engine announces the longest prefix (KV events), within a load bound
    prefixes.py, ring.py, records.py  what prefix-affinity hashes, walks and remembers
    adapter_affinity.py   wraps each: a LoRA adapter's requests go to a pod holding it, within the load bound
"""
from __future__ import annotations

from collections.abc import Callable

from kaon_operator.router.endpoints import ServiceKey
from kaon_operator.router.strategies.adapter_affinity import AdapterAffinity
from kaon_operator.router.strategies.base import Attempt, Choice, Strategy
from kaon_operator.router.strategies.kv_aware import KvAware
from kaon_operator.router.strategies.least_connections import LEAST_CONNECTIONS, LeastConnections
from kaon_operator.router.strategies.prefix_affinity import PrefixAffinity

__all__ = ["Attempt", "Choice", "Strategies", "Strategy", "STRATEGIES", "UnknownStrategy", "named"]

STRATEGIES: dict[str, Callable[[], Strategy]] = {
    LEAST_CONNECTIONS: LeastConnections,
    "prefix-affinity": PrefixAffinity,
    "kv-aware": KvAware,
}


class UnknownStrategy(ValueError):
    pass


def named(name: str) -> Callable[[], Strategy]:
    """The strategy class of a spec.routing.strategy value."""
    try:
        return STRATEGIES[name]
    except KeyError:
        raise UnknownStrategy(f"unknown routing strategy {name!r}: the strategies are "
                              f"{', '.join(STRATEGIES)}") from None


class Strategies:
    """A router's strategies by name, each made on first use, each behind adapter affinity (which
    passes the requests that name no adapter on to it)."""

    def __init__(self):
        self._made: dict[str, Strategy] = {}

    def get(self, name: str) -> Strategy:
        found = self._made.get(name)
        if found is None:
            found = self._made[name] = AdapterAffinity(named(name)())
        return found

    def forget(self, key: ServiceKey) -> None:
        for strategy in self._made.values():
            strategy.forget(key)
