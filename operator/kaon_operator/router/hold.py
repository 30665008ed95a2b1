"""Requests held while their InferenceService has no ready pod.

A service scaled to zero (or whose pods are all starting) should not answer 503 at once:
the request waits, bounded in number and time, until a pod turns ready. How many wait
per service is the scale-from-zero signal the autoscaler reads (`held()`, and the
`kaon_router_held_requests` gauge on /metrics).
"""
from __future__ import annotations

import asyncio

from kaon_operator.router.endpoints import ServiceKey


class HoldFull(Exception):
    """`max_queued` requests already wait for this service."""


class Hold:
    def __init__(self, max_queued: int):
        self.max_queued = max_queued
        self._held: dict[ServiceKey, int] = {}
        self._wakeups: dict[ServiceKey, asyncio.Event] = {}

    def held(self) -> dict[ServiceKey, int]:
        """Requests waiting now, per InferenceService (only those with any)."""
        return dict(self._held)

    def notify(self, key: ServiceKey) -> None:
        """The service changed (a pod came or went): every request held for it looks again."""
        wakeup = self._wakeups.pop(key, None)
        if wakeup is not None:
            wakeup.set()

    async def wait(self, key: ServiceKey, timeout: float) -> None:
        """Return at the service's next change, or after `timeout` seconds."""
        count = self._held.get(key, 0)
        if count >= self.max_queued:
            raise HoldFull(key)
        wakeup = self._wakeups.setdefault(key, asyncio.Event())
        self._held[key] = count + 1
        try:
            await asyncio.wait_for(wakeup.wait(), timeout)
        except TimeoutError:
            pass
        finally:
            self._held[key] -= 1
            if not self._held[key]:
                del self._held[key]
