"""The standby loop (spec.autoscaling.standby): every INTERVAL_SECONDS, for each service with standbys,
ask its loaded engine pods whether they sleep, then wake or put to sleep what standby.plan says, mark
the pods (the kaon.dev/asleep pod condition), post the Events. The decisions: standby.py.

The engines' sleep routes answer the service's admin key only (the adapter loop's key, from the
Secret `<name>-admin-key` the reconciler makes). Waking and sleeping are idempotent on the engine,
so two operator replicas running the loop do no harm.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

import aiohttp

from kaon_operator import api, spec_policy, urls
from kaon_operator.api import Key
from kaon_operator.autoscaling import standby
from kaon_operator.context import Context
from kaon_operator.lora import adapter_pods
from kaon_operator.lora.adapter_sync import api_key
from kaon_operator.status.conditions import EventSpec
from kaon_operator.status.summaries import PodSummary

logger = logging.getLogger("kaon.standby")

INTERVAL_SECONDS = 2.0  # a scale-up waits for the next round to wake a standby: keep it short
ASK_TIMEOUT_SECONDS = 3.0
SLEEP_TIMEOUT_SECONDS = 60.0  # a sleep waits for the requests in flight (the engine's --sleep-grace-period)
WAKE_TIMEOUT_SECONDS = 60.0  # level 1: the pool allocated again (and on a GPU the weights copied back)


class StandbyLoop:
    def __init__(self, ctx: Context, interval: float = INTERVAL_SECONDS,
                 url_of: Callable[[PodSummary], str] = urls.engine_url):
        self.ctx, self.interval, self.url_of = ctx, interval, url_of

    async def run(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            while True:
                try:
                    await self.tick_all(session)
                except Exception as exc:  # noqa: BLE001 - the next round tries again
                    logger.warning(f"standby round failed: {exc}")
                await asyncio.sleep(self.interval)

    async def tick_all(self, session: aiohttp.ClientSession) -> None:
        rounds = []
        for key, body in self.ctx.caches.all_inference_services():
            spec = spec_policy.checked(body.get("spec") or {}, self.ctx.config.spec_policy)
            if not isinstance(spec, str) and standby.standby_count(spec):
                rounds.append(self._round(session, key, body, spec))
        await asyncio.gather(*rounds)

    async def _round(self, session: aiohttp.ClientSession, key: Key, body: Mapping,
                     spec: api.InferenceServiceSpec) -> None:
        try:
            await self.tick(session, key, body, spec)
        except Exception as exc:  # noqa: BLE001 - this service's next round tries again
            logger.warning(f"{key}: standby round failed: {exc}")

    async def tick(self, session: aiohttp.ClientSession, key: Key, body: Mapping,
                   spec: api.InferenceServiceSpec) -> None:
        uid = (body.get("metadata") or {}).get("uid")
        data = await asyncio.to_thread(self.ctx.kube.secret_data, key[0], adapter_pods.admin_secret_name(key[1]), uid)
        found = api_key(data)
        if found is None:
            return  # the reconciler has not made the key yet
        headers = {"Authorization": f"Bearer {found}"}
        candidates = [p for p in self.ctx.caches.pods(key) if p.containers_ready or p.ready or p.asleep]
        candidates = [p for p in candidates if p.ip and not p.terminating]
        urls_of = {p.name: self.url_of(p) for p in candidates}
        created = {p.name: p.created for p in candidates}
        answers = await asyncio.gather(*(self._is_sleeping(session, url, headers) for url in urls_of.values()))
        loaded = [standby.Loaded(name, asleep, created[name]) for name, asleep in zip(urls_of, answers, strict=True)
                  if asleep is not None]
        marked = {p.name: p.asleep for p in candidates}
        for pod in loaded:  # a pod woken or put to sleep by hand, or a round cut short, is marked as it is
            if marked.get(pod.name) != pod.asleep:
                await asyncio.to_thread(self.ctx.kube.set_pod_condition, key[0], pod.name,
                                        standby.asleep_condition(pod.asleep))
        todo = standby.plan(loaded, spec.replicas)
        refused: dict[str, str] = {}  # pod -> why its engine did not wake or sleep
        for route, names in (("wake_up", todo.wake), (f"sleep?level={standby.SLEEP_LEVEL}", todo.sleep)):
            for name in names:
                why = await self._act(session, urls_of[name], headers, route, key, name)
                if why is not None:
                    refused[name] = why
        done = standby.Plan(wake=[n for n in todo.wake if n not in refused],
                            sleep=[n for n in todo.sleep if n not in refused])
        for name in done.wake:
            await asyncio.to_thread(self.ctx.kube.set_pod_condition, key[0], name, standby.asleep_condition(False))
        for name in done.sleep:
            await asyncio.to_thread(self.ctx.kube.set_pod_condition, key[0], name, standby.asleep_condition(True))
        awake = sum(not p.asleep for p in loaded)
        events = [EventSpec("Normal", reason, message)
                  for reason, message in standby.summary(done, awake, spec.replicas)]
        if refused:
            events.append(EventSpec("Warning", "StandbyFailed", standby.failure_message(refused)))
        if events:
            await asyncio.to_thread(self.ctx.post, body, events)

    @staticmethod
    async def _is_sleeping(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> bool | None:
        try:
            async with session.get(f"{url}/is_sleeping", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=ASK_TIMEOUT_SECONDS)) as response:
                if response.status != 200:
                    return None
                answer = await response.json()
                return answer.get("is_sleeping") if isinstance(answer.get("is_sleeping"), bool) else None
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError):
            return None

    @staticmethod
    async def _act(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str], route: str, key: Key,
                   pod: str) -> str | None:
        """None once the engine did it; else why not, as the engine said it (its error's message)."""
        timeout = WAKE_TIMEOUT_SECONDS if route == "wake_up" else SLEEP_TIMEOUT_SECONDS
        try:
            async with session.post(f"{url}/{route}", headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                if response.status == 200:
                    return None
                why = standby.engine_refusal(response.status, await response.text())
        except (aiohttp.ClientError, TimeoutError) as exc:
            why = f"{type(exc).__name__}: {exc}"
        logger.warning(f"{key}: POST /{route} on {pod}: {why}")
        return why
