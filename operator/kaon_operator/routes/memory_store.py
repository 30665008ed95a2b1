"""The response cache in the router's memory (the default): entries expire after the route's TTL and
the least recently used go first past its size bound. The semantic index keeps each cached prompt's
embedding (unit length) beside its entry's key, per semantic scope (cache_keys.semantic_scope).

No I/O; `now` is the caller's monotonic clock. The async methods are the store's interface, shared
with valkey_store.py."""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kaon_operator import clock
from kaon_operator.routes.answers import Answer


def unit(vector: Sequence[float]) -> tuple[float, ...]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return tuple(x / norm for x in vector)


def cosine_of_units(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


class MemoryStore:
    def __init__(self, max_entries: int, now: Callable[[], float] = clock.monotonic):
        self.max_entries = max_entries
        self.now = now
        self._entries: OrderedDict[str, tuple[float, Answer]] = OrderedDict()
        self._vectors: dict[str, OrderedDict[str, tuple[float, tuple[float, ...]]]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> Answer | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, answer = found
        if expires <= self.now():
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return answer

    async def put(self, key: str, answer: Answer, ttl: float) -> None:
        self._entries[key] = (self.now() + ttl, answer)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    async def nearest(self, scope: str, vector: Sequence[float]) -> tuple[float, str] | None:
        """The most similar live entry's (cosine, key) in `scope`, or None."""
        index = self._vectors.get(scope)
        if not index:
            return None
        query, now, best = unit(vector), self.now(), None
        for key, (expires, v) in list(index.items()):
            if expires <= now or key not in self._entries:  # expired, or its answer evicted
                del index[key]
                continue
            similarity = cosine_of_units(query, v)
            if best is None or similarity > best[0]:
                best = (similarity, key)
        return best

    async def add_vector(self, scope: str, vector: Sequence[float], key: str, ttl: float) -> None:
        index = self._vectors.setdefault(scope, OrderedDict())
        index[key] = (self.now() + ttl, unit(vector))
        while len(index) > self.max_entries:
            index.popitem(last=False)

    async def close(self) -> None:
        pass
