"""A consistent-hash ring of pods: a pod joining or leaving moves only about 1/N of the keys.

Each pod sits on the ring at many points, so that the arcs it owns are many and small and the
keys spread evenly; a key's owner is the first pod clockwise from it.
"""
from __future__ import annotations

import bisect
from collections.abc import Hashable, Sequence
from typing import Generic, TypeVar

from kaon_operator.router.strategies.prefixes import stable_hash

T = TypeVar("T", bound=Hashable)
K = TypeVar("K", bound=Hashable)

VIRTUAL_NODES = 160


class Ring(Generic[T]):
    """The members, VIRTUAL_NODES points each (hashed from `name(member)`)."""

    def __init__(self, members: Sequence[T], name=str, vnodes: int = VIRTUAL_NODES):
        self.members = tuple(members)
        points = sorted((stable_hash(f"{name(m)}#{i}".encode()), m) for m in self.members for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [m for _, m in points]

    def walk(self, key: int) -> list[T]:
        """Every member once, in ring order from the key's point."""
        if not self._keys:
            return []
        start, seen, order = bisect.bisect(self._keys, key), set(), []
        n = len(self._keys)
        for i in range(n):
            m = self._owners[(start + i) % n]
            if m not in seen:
                seen.add(m)
                order.append(m)
                if len(order) == len(self.members):
                    break
        return order


class Rings(Generic[K, T]):
    """One ring per key (a service), rebuilt only when its members (the ready pods) change."""

    def __init__(self, name=str):
        self._name = name
        self._rings: dict[K, Ring[T]] = {}

    def of(self, key: K, members: tuple[T, ...]) -> Ring[T]:
        ring = self._rings.get(key)
        if ring is None or ring.members != members:
            ring = self._rings[key] = Ring(members, name=self._name)
        return ring

    def forget(self, key: K) -> None:
        self._rings.pop(key, None)
