"""The operator's own long-running tasks, started once at start-up (no per-object timers, so
no finalizers): the status queue's workers, the startup watch, the records' sweep, the key digests'
publisher, the autoscale loop, the standby loop, the routers' pressure loop and the adapter loop."""
from __future__ import annotations

import asyncio
import logging
from functools import partial

from kaon_operator import clock, key_digests
from kaon_operator.autoscaling.autoscale_loop import AutoscaleLoop
from kaon_operator.autoscaling.pressure_sync import PressureLoop
from kaon_operator.autoscaling.standby_sync import StandbyLoop
from kaon_operator.context import Context
from kaon_operator.lora.adapter_sync import AdapterLoop
from kaon_operator.status import conditions, status_sync

STARTUP_CHECK_SECONDS = 5.0
SWEEP_SECONDS = 30.0

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


def forget_the_gone(ctx: Context) -> None:
    """Forget the records of InferenceServices the caches no longer hold. The delete handler forgets
    a service's record at once, but a loop's round that read the caches just before the deletion
    can make it again; a record must not outlive its service (one made again under its name would
    inherit it)."""
    for key, _ in ctx.records.items():
        if ctx.caches.inference_service(key) is None:
            ctx.records.forget(key)


async def sweep_records(ctx: Context) -> None:
    while True:
        await asyncio.sleep(SWEEP_SECONDS)
        forget_the_gone(ctx)


def start(ctx: Context) -> None:
    ctx.run_in_background(ctx.status_queue.run(partial(status_sync.resync, ctx)))
    ctx.run_in_background(watch_startups(ctx))
    ctx.run_in_background(sweep_records(ctx))
    ctx.run_in_background(key_digests.publish_loop(ctx))
    autoscale, standby = AutoscaleLoop(ctx), StandbyLoop(ctx)
    ctx.run_in_background(autoscale.run())
    ctx.run_in_background(AdapterLoop(ctx, interval=ctx.config.adapter_interval).run())
    ctx.run_in_background(standby.run())
    ctx.run_in_background(PressureLoop(ctx, standby, leading=lambda: autoscale.leading).run())
