"""least-connections: the usable pod with the fewest requests in flight.

LLM requests last from milliseconds to minutes, so counting them beats taking turns. Ties go
at random, so that idle replicas share a burst instead of the first in the list taking it all.
"""
from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any, TypeVar

from kaon_operator.router.endpoints import ServiceKey
from kaon_operator.router.strategies.base import Attempt, Choice

T = TypeVar("T", bound=Hashable)
LEAST_CONNECTIONS = "least-connections"  # its spec.routing.strategy name


def least(items: Sequence[T], key: Callable[[T], Any], rng: random.Random) -> T:
    """The item with the smallest key; ties at random. A fixed order would give every tie to
    the same pod: a burst of one prompt onto one of several equally loaded holders of it, its
    cheap cached prefills there and the costly uncached ones elsewhere (the same requests in
    flight everywhere, unequal work)."""
    keys = [key(m) for m in items]  # once each: this runs on every request
    lowest = min(keys)
    tied = [m for m, k in zip(items, keys) if k == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def pick(endpoints: Sequence[T], inflight: Mapping[T, int], rng: random.Random) -> T:
    """The endpoint with the fewest requests in flight (ties at random): least() with the counts as the key, in one
    pass without a key function (this runs on every request), the same ties in the same order."""
    get = inflight.get
    first = endpoints[0]
    lowest = get(first, 0)
    tied: list[T] | None = None
    for endpoint in endpoints[1:]:
        count = get(endpoint, 0)
        if count < lowest:
            first, lowest, tied = endpoint, count, None
        elif count == lowest:
            if tied is None:
                tied = [first]
            tied.append(endpoint)
    return first if tied is None else rng.choice(tied)


class LeastConnections:
    def pick(self, attempt: Attempt) -> Choice:
        return Choice(pick(attempt.usable, attempt.inflight, attempt.rng))

    def forget(self, key: ServiceKey) -> None:
        pass  # it keeps nothing
