"""What every handler shares, kept in kopf's memo (handlers.py builds it at start-up): the
configuration, the API client, the caches, one record per InferenceService, the status queue
and the operator's own background tasks."""
from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import kopf

from kaon_operator.caches import Caches
from kaon_operator.config import OperatorConfig
from kaon_operator.kube import Kube
from kaon_operator.records import Records
from kaon_operator.status.conditions import EventSpec
from kaon_operator.status.status_queue import StatusQueue
from kaon_operator.watching import reporting_instance

APPLY_THREADS = 32  # as many as the API client's connection pool (Kube.from_environment)


def _appliers() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=APPLY_THREADS, thread_name_prefix="apply")


@dataclass
class Context:
    config: OperatorConfig
    kube: Kube
    caches: Caches
    records: Records = field(default_factory=Records)
    status_queue: StatusQueue = field(default_factory=StatusQueue)
    appliers: ThreadPoolExecutor = field(default_factory=_appliers)
    """Applies one service's children at once: one round trip's latency, not four."""
    name_peers: dict[str, tuple] = field(default_factory=dict)
    """The served names last judged per namespace (NameConflict)."""
    tasks: list[asyncio.Task] = field(default_factory=list)

    def post(self, body, events: list[EventSpec]) -> None:
        for event in events:
            try:
                kopf.event(body, type=event.type, reason=event.reason, message=event.message)
            except LookupError:  # outside kopf's per-object tasks (the autoscale loop): no queue to post through
                self.kube.post_event(body, event.type, event.reason, event.message, reporting_instance())

    def run_in_background(self, work: Coroutine) -> None:
        """A task of the operator's own (not per object, so no finalizer), cancelled at cleanup."""
        self.tasks.append(asyncio.get_running_loop().create_task(work))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
