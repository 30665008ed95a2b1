"""The operator's own long-running tasks, started once at start-up (no per-object timers, so
no finalizers): the status queue's workers, the startup watch, the key digests' publisher, the
autoscale loop and the adapter loop."""
from __future__ import annotations

import asyncio
import logging
from functools import partial

from kaon_operator import clock, key_digests
from kaon_operator.autoscaling.autoscale_loop import AutoscaleLoop
from kaon_operator.context import Context
from kaon_operator.lora.adapter_sync import AdapterLoop
from kaon_operator.status import conditions, status_sync

STARTUP_CHECK_SECONDS = 5.0

logger = logging.getLogger("kaon.status")


async def watch_startups(ctx: Context) -> None:
    """A pod that stays not ready past its probes' budget changes nothing the watches see: judge
    the services whose pods ran out of it again (StartupTimeout), every few seconds, from the caches."""
    while True:
        await asyncio.sleep(STARTUP_CHECK_SECONDS)
        now = clock.now().replace(microsecond=0)
        for key, pods in ctx.caches.pods_by_service():
            deadline = conditions.next_startup_deadline(pods)
            if deadline is None or deadline > now:
                continue
            try:
                await asyncio.to_thread(status_sync.resync, ctx, key)
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                logger.warning(f"judging {key[0]}/{key[1]}'s startup failed: {exc}")


def start(ctx: Context) -> None:
    ctx.run_in_background(ctx.status_queue.run(partial(status_sync.resync, ctx)))
    ctx.run_in_background(watch_startups(ctx))
    ctx.run_in_background(key_digests.publish_loop(ctx))
    ctx.run_in_background(AutoscaleLoop(ctx).run())
    ctx.run_in_background(AdapterLoop(ctx).run())
