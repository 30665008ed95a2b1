"""The response cache in the router's memory (the default): entries expire after the route's TTL and
the least recently used go first past its size bounds: `maxEntries`, and MAX_BYTES of answers (an answer over
MAX_ANSWER_BYTES is not kept at all). The semantic index keeps each cached prompt's embedding (unit length)
beside its entry's key, per semantic scope (cache_keys.semantic_scope), at most `maxEntries` over all scopes.

Why bytes too: one answer may be megabytes (n, logprobs, a long max_tokens), and a client sending distinct
deterministic requests filled 10,000 entries of them, past the router's memory limit, for every tenant; and
each API key (any token, on an open route) is a scope of its own, whose embeddings stayed until that scope was
asked again.

No I/O; `now` is the caller's monotonic clock. The async methods are the store's interface, shared
with valkey_store.py."""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from kaon_operator import clock
from kaon_operator.routes.answers import Answer

MAX_BYTES = 64 << 20
"""Answers' bytes one route's store keeps (a router serves many routes within its memory limit)."""
MAX_ANSWER_BYTES = 1 << 20
"""A larger answer is relayed but not kept."""
ENTRY_OVERHEAD = 512  # bytes of Python objects around an entry's chunks (key, tuple, Answer, OrderedDict slot)


def held_bytes(answer: Answer) -> int:
    return sum(map(len, answer.chunks)) + len(answer.prompt) + ENTRY_OVERHEAD + 64 * len(answer.chunks)


def unit(vector: Sequence[float]) -> tuple[float, ...]:
    norm = math.sqrt(sum(x * x for x in vector)) or 1.0
    return tuple(x / norm for x in vector)


def cosine_of_units(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(x * y for x, y in zip(a, b))


class MemoryStore:
    def __init__(self, max_entries: int, now: Callable[[], float] = clock.monotonic, max_bytes: int = MAX_BYTES):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.now = now
        self._entries: OrderedDict[str, tuple[float, Answer]] = OrderedDict()
        self.bytes = 0
        """held_bytes of the entries kept."""
        self._vectors: dict[str, OrderedDict[str, tuple[float, tuple[float, ...]]]] = {}
        self._vector_order: OrderedDict[tuple[str, str], None] = OrderedDict()
        """(scope, key) of every embedding kept, oldest first: the bound over all scopes."""

    def __len__(self) -> int:
        return len(self._entries)

    async def get(self, key: str) -> Answer | None:
        found = self._entries.get(key)
        if found is None:
            return None
        expires, answer = found
        if expires <= self.now():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return answer

    async def put(self, key: str, answer: Answer, ttl: float) -> None:
        if key in self._entries:
            self._drop(key)
        size = held_bytes(answer)
        if size > min(MAX_ANSWER_BYTES, self.max_bytes):
            return
        self._entries[key] = (self.now() + ttl, answer)
        self.bytes += size
        while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        _, answer = self._entries.pop(key)
        self.bytes -= held_bytes(answer)

    async def nearest(self, scope: str, vector: Sequence[float]) -> tuple[float, str] | None:
        """The most similar live entry's (cosine, key) in `scope`, or None."""
        index = self._vectors.get(scope)
        if not index:
            return None
        query, now, best = unit(vector), self.now(), None
        for key, (expires, v) in list(index.items()):
            if expires <= now or key not in self._entries:  # expired, or its answer evicted
                del index[key]
                self._vector_order.pop((scope, key), None)
                continue
            similarity = cosine_of_units(query, v)
            if best is None or similarity > best[0]:
                best = (similarity, key)
        return best

    async def add_vector(self, scope: str, vector: Sequence[float], key: str, ttl: float) -> None:
        index = self._vectors.setdefault(scope, OrderedDict())
        index[key] = (self.now() + ttl, unit(vector))
        self._vector_order[(scope, key)] = None
        self._vector_order.move_to_end((scope, key))
        while len(self._vector_order) > self.max_entries:  # over all scopes: the oldest goes
            (old_scope, old_key), _ = self._vector_order.popitem(last=False)
            old_index = self._vectors.get(old_scope)
            if old_index is not None:
                old_index.pop(old_key, None)
                if not old_index:
                    del self._vectors[old_scope]

    def vectors(self) -> int:
        """Embeddings kept, over all scopes."""
        return sum(map(len, self._vectors.values()))

    async def close(self) -> None:
        pass
