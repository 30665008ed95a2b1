"""The adapter loop: keeps every ready engine pod holding exactly spec.adapters, without a restart.

One task for the whole operator (like the autoscale loop: no kopf timer, so no finalizer). Every
INTERVAL_SECONDS, for each InferenceService with adapters (or that had some last round), it reads
each ready pod's /v1/models, loads and unloads through `POST /v1/load_lora_adapter` /
`/v1/unload_lora_adapter` (vLLM's names, with the engine's admin key: adapter_pods.py) what
adapters.plan says, and writes status.adapters and the AdaptersReady condition. A pod that does not
answer is left out of the round. A load that fails (the engine could not fetch the adapter, or it
does not fit the model) leaves the base serving: the condition and a Warning Event name the
adapter and the reason, and the load is retried after RETRY_SECONDS, not every round.
A pod whose containers are ready but whose adapter readiness gate (adapter_pods.ADAPTERS_GATE) is
not set yet is served too, and once it holds every adapter (or its load failed: adapters.settled)
the loop sets the gate's pod condition, and the pod turns Ready: a scale-up never answers 404 for
an adapter of spec.adapters.
Loads and unloads are idempotent, so two operator replicas running the loop do no harm.

A tenant's pod is the tenant's code as far as the loop knows, so it bounds what a pod can cost it:
each service's round is its own task (a pod that holds a load for LOAD_TIMEOUT_SECONDS delays
only its own service: the next rounds skip a service whose task still runs, and start the
others'), the pool's connections are not shared out (a stalled tenant cannot hold the slots
another's requests wait for), and every body read from a pod is capped (MAX_MODELS_BYTES,
MAX_ERROR_BYTES: a larger /v1/models leaves the pod out of the round, a larger error is cut).
A spec the admin's policy refuses (spec_policy.checked) is skipped: no key goes to its pods; and the
admin key is read only from a Secret the service controls (one planted under its name is not sent).
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
from collections.abc import Callable, Mapping

import aiohttp

from kaon_operator import api, clock, kubetime, spec_policy, urls
from kaon_operator.api import Key
from kaon_operator.context import Context
from kaon_operator.lora import adapter_pods, adapters
from kaon_operator.records import AdapterMemory
from kaon_operator.status import conditions, status_sync
from kaon_operator.status.conditions import EventSpec
from kaon_operator.status.summaries import PodSummary

logger = logging.getLogger("kaon.adapters")

INTERVAL_SECONDS = 10.0
RETRY_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 5.0
LOAD_TIMEOUT_SECONDS = 600.0  # a load may download the adapter first
UNLOAD_TIMEOUT_SECONDS = 30.0
MAX_MODELS_BYTES = 1 << 20  # /v1/models with MAX_ADAPTERS adapters is a few kilobytes
MAX_ERROR_BYTES = 16 << 10  # the reason shown is 300 characters


def api_key(data: Mapping[str, str] | None) -> str | None:
    """One accepted key of spec.auth's Secret (base64 values as the apiserver sends them)."""
    for value in sorted((data or {}).values()):
        try:
            return base64.b64decode(value).decode().strip() or None
        except (ValueError, UnicodeDecodeError):
            continue
    return None


async def read_at_most(response: aiohttp.ClientResponse, limit: int) -> tuple[bytes, bool]:
    """Up to `limit` bytes of the body, and whether there was more (not read: the connection is dropped)."""
    body = bytearray()
    async for chunk in response.content.iter_chunked(1 << 16):
        body += chunk
        if len(body) > limit:
            return bytes(body[:limit]), True
    return bytes(body), False


async def _reason(response: aiohttp.ClientResponse) -> str:
    body, _ = await read_at_most(response, MAX_ERROR_BYTES)
    text = body.decode(errors="replace")
    try:
        return str(json.loads(text)["error"]["message"])[:300]
    except (ValueError, KeyError, TypeError, RecursionError):
        return text.strip()[:300] or f"HTTP {response.status}"


def _gate_condition(failed: list[str]) -> dict:
    return {"type": adapter_pods.ADAPTERS_GATE, "status": "True", "lastTransitionTime": kubetime.stamp(clock.now()),
            "reason": "AdaptersLoaded" if not failed else "AdaptersFailed",
            "message": "every adapter of spec.adapters is loaded" if not failed else
                       f"loaded all but {', '.join(sorted(failed))} (see AdaptersReady); the base model serves"}


class AdapterLoop:
    def __init__(self, ctx: Context, interval: float = INTERVAL_SECONDS,
                 url_of: Callable[[PodSummary], str] = urls.engine_url):
        self.ctx, self.interval, self.url_of = ctx, interval, url_of
        self.tasks: dict[Key, asyncio.Task] = {}
        """Each service's running round: a slow one is left to finish while the others go on."""

    async def run(self) -> None:
        # No pool-wide connection limit: the pods of one tenant that answer slowly must not hold
        # the connections every other tenant's round waits for (each round's are bounded by its pods).
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
            try:
                while True:
                    try:
                        await self.tick_all(session)
                    except Exception as exc:  # noqa: BLE001 - the next round tries again
                        logger.warning(f"adapter round failed: {exc}")
                    await asyncio.sleep(self.interval)
            finally:
                for task in self.tasks.values():
                    task.cancel()

    async def tick_all(self, session: aiohttp.ClientSession) -> None:
        """Start a round for every service with adapters whose last round is over, and wait for them
        up to `interval`: a round that takes longer runs on, and delays no other service."""
        live, started = set(), []
        for key, body in self.ctx.caches.all_inference_services():
            spec = spec_policy.checked(body.get("spec") or {}, self.ctx.config.spec_policy)
            record = self.ctx.records.find(key)
            if isinstance(spec, str) or (not spec.adapters and (record is None or record.adapters is None)):
                continue
            live.add(key)
            running = self.tasks.get(key)
            if running is None or running.done():
                self.tasks[key] = task = asyncio.create_task(self._round(session, key, body, spec))
                started.append(task)
        for key in [k for k in self.tasks if k not in live]:
            self.tasks.pop(key).cancel()
        for key, record in self.ctx.records.items():
            if key not in live:
                record.adapters = None
        if started:
            await asyncio.wait(started, timeout=self.interval)

    async def _round(self, session: aiohttp.ClientSession, key: Key, body: Mapping,
                     spec: api.InferenceServiceSpec) -> None:
        try:
            await self.tick(session, key, body, spec)
        except Exception as exc:  # noqa: BLE001 - this service's next round tries again
            logger.warning(f"{key}: adapter round failed: {exc}")

    async def _headers(self, key: Key, uid: str | None) -> dict[str, str]:
        """The engine's admin key (it opens /v1/models too), from the service's own Secret."""
        data = await asyncio.to_thread(self.ctx.kube.secret_data, key[0], adapter_pods.admin_secret_name(key[1]),
                                       uid)
        found = api_key(data)
        return {"Authorization": f"Bearer {found}"} if found else {}

    async def tick(self, session: aiohttp.ClientSession, key: Key, body: Mapping,
                   spec: api.InferenceServiceSpec) -> None:
        record = self.ctx.records.get(key)
        state = record.adapters = record.adapters or AdapterMemory()
        headers = await self._headers(key, (body.get("metadata") or {}).get("uid"))
        serving = [p for p in self.ctx.caches.adapter_pods(key)
                   if (p.ready or p.containers_ready) and not p.terminating and p.ip]
        urls = {p.name: self.url_of(p) for p in serving}
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
        for pod in (p.name for p in serving if adapter_pods.ADAPTERS_GATE in p.gates_pending):
            failed = [n for pn, n in state.failed_at if pn == pod]
            if pod in pods and adapters.settled(want, pods[pod], failed):
                await asyncio.to_thread(self.ctx.kube.set_pod_condition, key[0], pod, _gate_condition(failed))
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
                if response.status != 200 or (response.content_length or 0) > MAX_MODELS_BYTES:
                    return None
                body, more = await read_at_most(response, MAX_MODELS_BYTES)
                return None if more else adapters.held(json.loads(body))
        except (aiohttp.ClientError, TimeoutError, ValueError, RecursionError):
            return None

    @staticmethod
    async def _act(session: aiohttp.ClientSession, url: str, headers: Mapping[str, str],
                   action: adapters.Action) -> str | None:
        """None when done, else why not."""
        body = {"lora_name": action.name, **({"lora_path": action.path} if action.op == "load" else {})}
        try:
            async with session.post(f"{url}/v1/{action.op}_lora_adapter", json=body, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=LOAD_TIMEOUT_SECONDS if action.op == "load"
                                                                  else UNLOAD_TIMEOUT_SECONDS)) as response:
                if response.status == 200 or (action.op == "unload" and response.status == 404):
                    return None
                return await _reason(response)
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"
