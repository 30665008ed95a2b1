"""Which pods a request may try next, and outlier ejection: pods that just failed get no new
requests for a while. Pure decisions, with the clock passed in."""
from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Hashable)


def candidates(endpoints: Sequence[T], tried: Collection[T], backoff_until: Mapping[T, float], now: float) -> list[T]:
    """The endpoints a request may go to next: not tried by it yet, and not backing off.
    When every untried one is backing off they are all candidates again: a back-off is a
    preference for pods that did not just fail, never a reason to refuse the request."""
    if not tried and not backoff_until:  # the common case: a first attempt while no pod failed
        return list(endpoints)
    fresh = [e for e in endpoints if e not in tried]
    healthy = [e for e in fresh if backoff_until.get(e, 0.0) <= now]
    return healthy or fresh


def ejection_seconds(base: float, consecutive: int, cap: int = 8) -> float:
    """How long a pod that failed `consecutive` times in a row is ejected: `base` doubled per
    failure after the first, at most `cap` times `base` (Envoy's outlier ejection, simplified:
    a pod that keeps failing after it is let back in stays out longer)."""
    return base * min(2 ** (consecutive - 1), cap)


class Backoff(Generic[T]):
    """Outlier ejection: a pod that just failed (a refused or reset connection, a stream
    broken off, a timeout) gets no new requests until its ejection runs out; then one request
    tries it again, and an answer clears its record. The watch clears it too: a pod that left
    the ready set and came back (restarted, Ready again) starts fresh (`keep_only`)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.until: dict[T, float] = {}
        self.failures: dict[T, int] = {}
        """Consecutive failures per pod, kept after the ejection ran out so a relapse counts."""

    def fail(self, endpoint: T, now: float) -> float:
        """Eject the pod; returns for how many seconds."""
        # Forget the expired ones here, so pods that are long gone do not pile up.
        self.until = {e: t for e, t in self.until.items() if t > now}
        count = self.failures[endpoint] = self.failures.get(endpoint, 0) + 1
        seconds = ejection_seconds(self.seconds, count)
        self.until[endpoint] = now + seconds
        return seconds

    def succeed(self, endpoint: T) -> None:
        """The pod answered: its record is clean again."""
        if endpoint in self.failures:
            del self.failures[endpoint]
            self.until.pop(endpoint, None)

    def ejected(self, now: float) -> list[T]:
        return [e for e, t in self.until.items() if t > now]

    def keep_only(self, present: Callable[[T], bool]) -> None:
        """Forget pods for which `present` is False: they left the ready set (gone, not ready,
        restarting), so when they are back the watch has seen them ready anew."""
        self.until = {e: t for e, t in self.until.items() if present(e)}
        self.failures = {e: n for e, n in self.failures.items() if present(e)}
