"""What prefix-affinity remembers of its own choices: where each prefix chunk went
(KnownPrefixes), and where each conversation lives while it is active (Homes). Both bounded."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence

KNOWN_PREFIXES = 1 << 16
"""Chunk hashes the router remembers (about 100 bytes each): a few thousand conversations."""
HOME_WINDOW = 300.0
"""Seconds after its last request that a conversation still counts as active at its pod."""


class Homes:
    """The pod each conversation (by its anchor) last went to, for those active in the last
    `window` seconds: how many conversations each pod is home to (kept up to date as they
    come and go, so a request costs O(1) plus the expired entries). Bounded by `capacity`."""

    def __init__(self, window: float = HOME_WINDOW, capacity: int = KNOWN_PREFIXES):
        self.window, self.capacity = window, capacity
        self._last: OrderedDict[int, tuple[Hashable, float]] = OrderedDict()
        self._count: dict = {}

    def _drop(self, anchor: int) -> None:
        pod, _ = self._last.pop(anchor)
        self._count[pod] -= 1
        if not self._count[pod]:
            del self._count[pod]

    def touch(self, anchor: int, pod: Hashable, now: float) -> None:
        if anchor in self._last:
            self._drop(anchor)
        self._last[anchor] = (pod, now)
        self._count[pod] = self._count.get(pod, 0) + 1
        while len(self._last) > self.capacity:
            self._drop(next(iter(self._last)))

    def home(self, anchor: int, now: float) -> Hashable | None:
        """Where the conversation went last, if it is still active."""
        self.counts(now)
        found = self._last.get(anchor)
        return found[0] if found else None

    def counts(self, now: float) -> Mapping:
        while self._last:  # oldest first: drop the conversations that went quiet
            anchor, (_, seen) = next(iter(self._last.items()))
            if now - seen <= self.window:
                break
            self._drop(anchor)
        return self._count


class KnownPrefixes:
    """Which pods this router sent each prefix chunk to lately: a bounded LRU map."""

    def __init__(self, capacity: int = KNOWN_PREFIXES):
        self.capacity = capacity
        self._where: OrderedDict[int, frozenset] = OrderedDict()

    def get(self, h: int) -> frozenset:
        return self._where.get(h, frozenset())

    def record(self, hashes: Sequence[int], target: Hashable) -> None:
        for h in hashes:
            self._where[h] = self._where.pop(h, frozenset()) | {target}
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)
