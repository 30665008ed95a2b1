"""The pressure loop: every INTERVAL_SECONDS it reads each router's `GET /pressure` (admin port: the requests
it holds and has in flight per InferenceService, router/pressure.py) and, for a service with standby replicas
whose capacity is short (router_pressure.decide), writes spec.replicas at once, posts a `RouterPressure` Event
saying why, and wakes the standbys in the same breath (the standby loop's own round, not its next one).

The regular autoscale loop (every 5 s) still decides everything else on its scrapes: this loop only ever adds
replicas, and only by waking standbys. A router that does not answer, or a read lost, changes nothing but when
the wake comes. With several operator replicas only the autoscale Lease's holder acts (`leading`).
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable, Mapping

import aiohttp

from kaon_operator import api, clock, kubetime, spec_policy
from kaon_operator.api import Key
from kaon_operator.autoscaling import autoscale_loop, autoscaler, router_pressure, standby
from kaon_operator.autoscaling.standby_sync import StandbyLoop
from kaon_operator.context import Context
from kaon_operator.status.conditions import EventSpec

logger = logging.getLogger("kaon.pressure")

INTERVAL_SECONDS = 1.0
READ_TIMEOUT_SECONDS = 0.5  # a slow router is skipped this round: the next read comes in a second
ROUTER_LIST_SECONDS = 10.0  # router pods are listed this often, not every round (a LIST per second is load)
SETTLE_SECONDS = 5.0
"""After acting on a service, its pokes wait this long: the caches may still show the old spec.replicas,
and the pods woken need a readiness probe or two before the routers send to them."""


def pressure_url(pod: dict) -> str | None:
    metrics = autoscale_loop.router_url(pod)
    return None if metrics is None else metrics.removesuffix("/metrics") + "/pressure"


def merge(reports: list[Mapping]) -> dict[Key, router_pressure.Pressure]:
    """The routers' reports summed per service (held and in flight add up; ready: the most any router sees).
    A malformed report or entry is skipped."""
    out: dict[Key, router_pressure.Pressure] = {}
    for report in reports:
        for entry in report.get("services") or () if isinstance(report, Mapping) else ():
            try:
                key = Key(str(entry["namespace"]), str(entry["name"]))
                held, flying, ready = float(entry["held"]), float(entry["inFlight"]), int(entry["ready"])
            except (KeyError, TypeError, ValueError):
                continue
            before = out.get(key, router_pressure.Pressure(0.0, 0.0, 0))
            out[key] = router_pressure.Pressure(before.held + held, before.in_flight + flying,
                                                max(before.ready, ready))
    return out


class PressureLoop:
    def __init__(self, ctx: Context, standby_loop: StandbyLoop, leading: Callable[[], bool] = lambda: True,
                 interval: float = INTERVAL_SECONDS):
        self.ctx, self.standby_loop, self.leading, self.interval = ctx, standby_loop, leading, interval
        self.release_namespace = ctx.config.autoscale.release_namespace
        self._routers: list[str] = []
        self._listed_at = -ROUTER_LIST_SECONDS
        self._acted: dict[Key, float] = {}

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                started = clock.monotonic()
                try:
                    if self.leading():
                        await self.round(session)
                except Exception as exc:  # noqa: BLE001 - the next round tries again; the scrape decides meanwhile
                    logger.warning(f"pressure round failed: {exc}")
                await asyncio.sleep(max(0.0, self.interval - (clock.monotonic() - started)))

    def _candidates(self) -> dict[Key, tuple[Mapping, api.InferenceServiceSpec]]:
        out = {}
        for key, body in self.ctx.caches.all_inference_services():
            if (body.get("metadata") or {}).get("deletionTimestamp"):
                continue
            spec = spec_policy.checked(body.get("spec") or {}, self.ctx.config.spec_policy)
            if not isinstance(spec, str) and standby.standby_count(spec):
                out[key] = (body, spec)
        return out

    async def _router_urls(self) -> list[str]:
        if clock.monotonic() - self._listed_at >= ROUTER_LIST_SECONDS:
            pods = await asyncio.to_thread(self.ctx.kube.list_pods, self.release_namespace,
                                           autoscale_loop.ROUTER_PODS)
            self._routers = [url for url in map(pressure_url, pods) if url]
            self._listed_at = clock.monotonic()
        return self._routers

    async def round(self, session: aiohttp.ClientSession) -> None:
        services = self._candidates()
        if not services:
            return
        routers = await self._router_urls()
        reports = [r for r in await asyncio.gather(*(self._read(session, url) for url in routers)) if r is not None]
        now = clock.monotonic()
        for key, pressure in merge(reports).items():
            if key not in services or now - self._acted.get(key, -SETTLE_SECONDS) < SETTLE_SECONDS:
                continue
            body, spec = services[key]
            asleep = sum(p.asleep and not p.terminating for p in self.ctx.caches.pods(key))
            memory = self.ctx.records.get(key).autoscale  # the profile the autoscale loop read, if any
            slots = spec.engine.batch_slots(autoscale_loop.slots_measured(memory.model if memory else None))
            decision = router_pressure.decide(pressure, spec.autoscaling, spec.replicas, asleep, slots)
            if decision is not None:
                self._acted[key] = now
                await self._act(session, key, body, spec, decision)

    @staticmethod
    async def _read(session: aiohttp.ClientSession, url: str) -> Mapping | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=READ_TIMEOUT_SECONDS)) as response:
                if response.status != 200:
                    return None
                return json.loads(await response.read())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    async def _act(self, session: aiohttp.ClientSession, key: Key, body: Mapping, spec: api.InferenceServiceSpec,
                   decision: autoscaler.Decision) -> None:
        """spec.replicas and lastScaleDecision as the autoscale loop writes them (so the regular policy counts it
        as its last change), the Event, then the wake itself."""
        patch = {"lastScaleDecision": {"time": kubetime.stamp(clock.seconds()), "from": spec.replicas,
                                       "to": decision.replicas, "reason": decision.reason}}
        scaled = await asyncio.to_thread(autoscale_loop.write_scale, self.ctx, body, patch, decision.replicas)
        if not scaled:
            logger.info("%s/%s changed while waking standbys on the routers' pressure; the next round decides",
                        *key)
            return
        await asyncio.to_thread(self.ctx.post, body, [EventSpec(
            "Normal", "RouterPressure", f"Scaled up {spec.replicas} → {decision.replicas}: {decision.reason}")])
        await self.standby_loop.tick(session, key, body, spec.model_copy(update={"replicas": decision.replicas}))
