"""The adapter loop: keeps every ready engine pod holding exactly spec.adapters, without a restart.

One task for the whole operator (like the autoscale loop: no kopf timer, so no finalizer). Every
INTERVAL_SECONDS, for each InferenceService with adapters (or that had some last round), it reads
each ready pod's /v1/models, loads and unloads through `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` (vLLM's names, with the service's API key when spec.auth is set) what
adapters.plan says, and writes status.adapters and the AdaptersReady condition. A pod that does not
answer is left out of the round. A load that fails (the engine could not fetch the adapter, or it
does not fit the model) leaves the base serving: the condition and a Warning Event name the
adapter and the reason, and the load is retried after RETRY_SECONDS, not every round.
Loads and unloads are idempotent, so two operator replicas running the loop do no harm.
"""
from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Callable, Mapping

import aiohttp

from kaon_operator import api, clock, urls
from kaon_operator.api import Key
from kaon_operator.context import Context
from kaon_operator.lora import adapters
from kaon_operator.records import AdapterMemory
from kaon_operator.status import conditions, status_sync
from kaon_operator.status.conditions import EventSpec
from kaon_operator.status.summaries import PodSummary

logger = logging.getLogger("kaon.adapters")

INTERVAL_SECONDS = 10.0
RETRY_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 5.0
LOAD_TIMEOUT_SECONDS = 600.0  # a load may download the adapter first


def api_key(data: Mapping[str, str] | None) -> str | None:
    """One accepted key of spec.auth's Secret (base64 values as the apiserver sends them)."""
    for value in sorted((data or {}).values()):
        try:
            return base64.b64decode(value).decode().strip() or None
        except (ValueError, UnicodeDecodeError):
            continue
    return None


async def _reason(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        return str((await response.json(content_type=None))["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:300] or f"HTTP {response.status}"


class AdapterLoop:
    def __init__(self, ctx: Context, interval: float = INTERVAL_SECONDS,
                 url_of: Callable[[PodSummary], str] = urls.engine_url):
        self.ctx, self.interval, self.url_of = ctx, interval, url_of

    async def run(self) -> None:
        async with aiohttp.ClientSession() as session:
            while True:
                try:
                    await self.tick_all(session)
                except Exception as exc:  # noqa: BLE001 - the next round tries again
                    logger.warning(f"adapter round failed: {exc}")
                await asyncio.sleep(self.interval)

    async def tick_all(self, session: aiohttp.ClientSession) -> None:
        live = set()
        for key, body in self.ctx.caches.all_inference_services():
            spec = api.parse_spec(body.get("spec") or {})
            record = self.ctx.records.find(key)
            if isinstance(spec, str) or (not spec.adapters and (record is None or record.adapters is None)):
                continue
            live.add(key)
            await self.tick(session, key, body, spec)
        for key, record in self.ctx.records.items():
            if key not in live:
                record.adapters = None

    async def _headers(self, key: Key, spec: api.InferenceServiceSpec) -> dict[str, str]:
        if spec.auth is None:
            return {}
        data = await asyncio.to_thread(self.ctx.kube.secret_data, key[0], spec.auth.api_key_secret)
        found = api_key(data)
        return {"Authorization": f"Bearer {found}"} if found else {}

    async def tick(self, session: aiohttp.ClientSession, key: Key, body: Mapping,
                   spec: api.InferenceServiceSpec) -> None:
        record = self.ctx.records.get(key)
        state = record.adapters = record.adapters or AdapterMemory()
        headers = await self._headers(key, spec)
        urls = {p.name: self.url_of(p) for p in self.ctx.caches.pods(key)
                if p.ready and not p.terminating and p.ip}
        answers = await asyncio.gather(*(self._held(session, url, headers) for url in urls.values()))
        pods = {pod: found for pod, found in zip(urls, answers, strict=True) if found is not None}
        want, now = adapters.desired(spec), clock.monotonic()
        state.failures = {n: r for n, r in state.failures.items() if n in want}
        skip = [pk for pk, at in state.failed_at.items() if now - at < RETRY_SECONDS]
        events = []
        for action in adapters.plan(want, pods, skip):
            error = await self._act(session, urls[action.pod], headers, action)
            if error is None:
                have = dict(pods[action.pod])
                if action.op == "load":
                    have[action.name] = action.path
                    state.failed_at.pop((action.pod, action.name), None)
                    state.failures.pop(action.name, None)
                else:
                    have.pop(action.name, None)
                pods[action.pod] = have
            elif action.op == "load":
                state.failures[action.name] = error
                state.failed_at[(action.pod, action.name)] = now
                if (action.name, error) not in state.reported:
                    state.reported.add((action.name, error))
                    events.append(EventSpec("Warning", "AdapterLoadFailed",
                                            f"adapter {action.name} ({action.path}) could not be loaded on "
                                            f"{action.pod}: {error}; the base model keeps serving"))
        if events:
            await asyncio.to_thread(self.ctx.post, body, events)
        await self._report(key, state, want, pods)

    async def _report(self, key: Key, state: AdapterMemory, want: Mapping[str, str],
                      pods: Mapping[str, adapters.Held]) -> None:
        written = adapters.status(want, pods, state.failures)
        if written != state.written:
            await asyncio.to_thread(self.ctx.kube.patch_status, key[0], key[1], {"adapters": written or None})
            state.written = written
        condition = conditions.adapters_condition(want, pods, state.failures)
        if condition != self.ctx.records.get(key).conditions.get(conditions.ADAPTERS_READY):
            await asyncio.to_thread(status_sync.adapters_changed, self.ctx, key, condition)

    @staticmethod
    async def _held(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str]) -> dict[str, str] | None:
        try:
            async with session.get(f"{url}/v1/models", headers=headers,
                                   timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)) as response:
                return adapters.held(await response.json(content_type=None)) if response.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None

    @staticmethod
    async def _act(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str],
                   action: adapters.Action) -> str | None:
        """None when done, else why not."""
        body = {"lora_name": action.name, **({"lora_path": action.path} if action.op == "load" else {})}
        try:
            async with session.post(f"{url}/v1/{action.op}_lora_adapter", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_SECONDS)) as response:
                if response.status == 200 or (action.op == "unload" and response.status == 404):
                    return None
                return await _reason(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
