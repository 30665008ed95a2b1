"""The router writes each InferenceRoute's status (tier shares, cache hit rate, cost against the top
tier, the monitor's agreement, the Ready condition) every STATUS_SECONDS when it changed, and an Event
when the monitor escalates a class. The router is where these figures are. With several router
replicas each reads the route, then applies (server-side apply, a field manager per replica) its own
`status.replicas` entry and the totals over every replica's fresh entry (routes/replicas.py), so the
status is the sum of the replicas, never the figures of whichever wrote last. The entries of replicas
gone for 10 minutes are removed by whichever live replica reads them (`prune`)."""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import socket

import aiohttp

from kaon_operator import clock, kubetime
from kaon_operator.api import GROUP, VERSION, Key
from kaon_operator.router import unawaited
from kaon_operator.router.route_gateway import RouteGateway
from kaon_operator.routes import replicas, status as route_status
from kaon_operator.routes.table import Route

logger = logging.getLogger("kaon.routes.status")
STATUS_SECONDS = 10.0


class RouteStatusWriter:
    def __init__(self, server, gateway: RouteGateway, replica: str | None = None):
        """`server`: watch.ApiServer (its URL, TLS and credentials); `replica`: this router's name in
        `status.replicas` (default: $POD_NAME, else the host name, which is the pod's name in Kubernetes)."""
        self.server, self.gateway = server, gateway
        self.replica = replica or os.environ.get("POD_NAME") or socket.gethostname()
        self._written: dict[Key, dict] = {}
        self._written_at: dict[Key, float] = {}
        self._events: asyncio.Queue[tuple[Route, dict]] = asyncio.Queue()
        gateway.on_escalation.append(self._escalated)

    def _escalated(self, route: Route, tier: str, request_class: str, rate: float, samples: int,
                   escalated: bool) -> None:
        event = route_status.escalation_event if escalated else route_status.recovery_event
        self._events.put_nowait((route, event(route, tier, request_class, rate, samples)))

    async def run(self) -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.server.ssl)) as session:
            events = asyncio.create_task(self._post_events(session))
            events.add_done_callback(unawaited.log_failure(logger, "InferenceRoute Events' poster"))
            try:
                while True:
                    await asyncio.sleep(STATUS_SECONDS)
                    for route in self.gateway.routes.routes():
                        try:
                            await self._write(session, route)
                        except (aiohttp.ClientError, TimeoutError) as exc:
                            logger.info("InferenceRoute %s: status not written (%s); next round", route.key, exc)
            finally:
                events.cancel()

    def _url(self, key: Key) -> str:
        return f"{self.server.url}/apis/{GROUP}/{VERSION}/namespaces/{key.namespace}/inferenceroutes/{key.name}"

    async def _write(self, session: aiohttp.ClientSession, route: Route) -> None:
        table = self.gateway.table
        missing = [s for s in route.services if table.service(Key(route.key.namespace, s)) is None]
        timeout = aiohttp.ClientTimeout(total=10)
        # The other replicas' entries: read with `list` (the router's RBAC has list and watch, no get).
        collection = self._url(route.key).rpartition("/")[0]
        async with session.get(collection, params={"fieldSelector": f"metadata.name={route.key.name}"},
                               headers=self.server.headers(), timeout=timeout) as resp:
            if resp.status != 200:
                logger.info("InferenceRoute %s: not read (%d); status not written", route.key, resp.status)
                return
            items = (await resp.json()).get("items") or [{}]
            current = items[0].get("status") or {}
        now, stamp = clock.seconds(), _now()
        await self.prune(session, route.key, current, now)
        own = replicas.entry(self.replica, self.gateway.figures.get(route.key), self.gateway.agreement.get(route.key),
                             stamp)
        new = route_status.status(route, own, replicas.others(current, self.replica), missing, stamp, now,
                                  self._written.get(route.key) or current)
        if (_unstamped(self._written.get(route.key)) == _unstamped(new)
                and now - self._written_at.get(route.key, 0.0) < replicas.HEARTBEAT_SECONDS):
            return
        # Server-side apply under this replica's own field manager: it owns its `replicas` entry (a map
        # list keyed by name), so another replica's apply never removes it; force takes the totals over.
        body = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceRoute",
                "metadata": {"name": route.key.name, "namespace": route.key.namespace}, "status": new}
        headers = {**self.server.headers(), "Content-Type": "application/apply-patch+yaml"}
        params = {"fieldManager": f"kaon-router-{self.replica}"[:128], "force": "true"}
        async with session.patch(self._url(route.key) + "/status", data=json.dumps(body), params=params,
                                 headers=headers, timeout=timeout) as resp:
            if resp.status == 200:
                self._written[route.key], self._written_at[route.key] = new, now
            else:
                logger.info("InferenceRoute %s: status patch got %d: %s", route.key, resp.status,
                            (await resp.text())[:200])

    async def prune(self, session: aiohttp.ClientSession, key: Key, current: dict, now: float) -> bool:
        """Remove the entries of replicas gone for replicas.PRUNE_SECONDS from the status as read
        (`current`). Every live replica may try: the patch's `test` operations make the apiserver refuse
        it (422) when another replica removed them first or anything moved since the read, and then
        nothing is removed; the next round reads again. True when the apiserver removed them."""
        patch = replicas.prune_patch(current.get("replicas") or [], now, keep=self.replica)
        if not patch:
            return False
        headers = {**self.server.headers(), "Content-Type": "application/json-patch+json"}
        async with session.patch(self._url(key) + "/status", data=json.dumps(patch),
                                 params={"fieldManager": f"kaon-router-{self.replica}"[:128]}, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
            gone = [op["value"] for op in patch if op["path"].endswith("/name")]
            if resp.status == 200:
                logger.info("InferenceRoute %s: removed the status entries of gone router replicas %s", key, gone)
                return True
            # 422: a test failed (pruned by another replica, renewed, moved): nothing removed.
            logger.info("InferenceRoute %s: entries of %s not removed (%d); next round", key, gone, resp.status)
            return False

    async def _post_events(self, session: aiohttp.ClientSession) -> None:
        while True:
            route, event = await self._events.get()
            now = _now()
            body = {"apiVersion": "v1", "kind": "Event",
                    "metadata": {"name": f"{route.key.name}.{secrets.token_hex(8)}", "namespace": route.key.namespace},
                    "involvedObject": {"apiVersion": f"{GROUP}/{VERSION}", "kind": "InferenceRoute",
                                       "name": route.key.name, "namespace": route.key.namespace, "uid": route.uid},
                    "reason": event["reason"], "message": event["message"], "type": event["type"],
                    "firstTimestamp": now, "lastTimestamp": now, "count": 1,
                    "source": {"component": "kaon-router"}, "reportingComponent": "kaon-router"}
            url = f"{self.server.url}/api/v1/namespaces/{route.key.namespace}/events"
            try:
                async with session.post(url, json=body, headers=self.server.headers(),
                                        timeout=aiohttp.ClientTimeout(total=10)) as resp:
                    if resp.status >= 300:
                        logger.info("InferenceRoute %s: Event not posted (%d)", route.key, resp.status)
            except (aiohttp.ClientError, TimeoutError) as exc:
                logger.info("InferenceRoute %s: Event not posted (%s)", route.key, exc)


def _unstamped(status: dict | None) -> dict | None:
    """A status less its own entry's `updated` stamp: what tells whether anything changed."""
    if status is None:
        return None
    return {**status, "replicas": [{**e, "updated": ""} for e in status.get("replicas") or ()]}


def _now() -> str:
    return kubetime.stamp(clock.now())
