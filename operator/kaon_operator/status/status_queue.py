"""InferenceServices whose status must be recomputed after a pod or Deployment event, and the
workers that do it.

A key waits in the queue once however many events name it meanwhile, and is computed from the
caches as they are when a worker takes it: a burst of pod events (a rollout, hundreds of
services at once) costs one status write instead of one per event, and kopf's handler threads
stay free for reconciles. An idle queue adds no delay.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

STATUS_WORKERS = 8

logger = logging.getLogger("kaon.status")


class StatusQueue:
    def __init__(self, workers: int = STATUS_WORKERS):
        self.workers = workers
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queued: set = set()

    def mark(self, key) -> None:
        if key not in self.queued:
            self.queued.add(key)
            self.queue.put_nowait(key)

    async def run(self, resync: Callable[[tuple[str, str]], None]) -> None:
        """Recompute each marked key with `resync` (blocking: run in a thread)."""
        await asyncio.gather(*(self._work(resync) for _ in range(self.workers)))

    async def _work(self, resync: Callable[[tuple[str, str]], None]) -> None:
        while True:
            key = await self.queue.get()
            self.queued.discard(key)  # an event from now on queues it again
            try:
                await asyncio.to_thread(resync, key)
            except Exception:
                logger.exception(f"updating {key[0]}/{key[1]}'s status failed")
