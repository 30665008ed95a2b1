"""Which pod gets a request: pure decisions, with the clock and the randomness passed in."""
from __future__ import annotations

import random
from collections.abc import Collection, Hashable, Mapping, Sequence
from typing import TypeVar

T = TypeVar("T", bound=Hashable)


def pick(endpoints: Sequence[T], inflight: Mapping[T, int], rng: random.Random) -> T:
    """Least connections: the endpoint with the fewest requests in flight. LLM requests last
    from milliseconds to minutes, so counting them beats taking turns. Ties go at random,
    so that idle replicas share a burst instead of the first in the list taking it all."""
    least = min(inflight.get(e, 0) for e in endpoints)
    tied = [e for e in endpoints if inflight.get(e, 0) == least]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


def candidates(endpoints: Sequence[T], tried: Collection[T], backoff_until: Mapping[T, float], now: float) -> list[T]:
    """The endpoints a request may go to next: not tried by it yet, and not backing off.
    When every untried one is backing off they are all candidates again: a back-off is a
    preference for pods that did not just fail, never a reason to refuse the request."""
    fresh = [e for e in endpoints if e not in tried]
    healthy = [e for e in fresh if backoff_until.get(e, 0.0) <= now]
    return healthy or fresh


class Backoff:
    """Pods that just failed to connect are skipped for `seconds`."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.until: dict[Hashable, float] = {}

    def fail(self, endpoint: Hashable, now: float) -> None:
        # Forget the expired ones here, so pods that are long gone do not pile up.
        self.until = {e: t for e, t in self.until.items() if t > now}
        self.until[endpoint] = now + self.seconds
