"""Keeps an EndpointTable in step with the cluster: list, then watch, the engine pods (by their
label selector: no other pod is ever read) and the InferenceServices, in all namespaces or the
given ones. No Secret: the operator publishes the digests of spec.auth's keys in the
InferenceService's status (key_digests.py), so the router's identity may read no Secret.

Plain HTTP to the apiserver with aiohttp, so the watch lives on the proxy's event loop and
stops with it (the official client is synchronous). The official client still reads the
credentials: the pod's ServiceAccount in a cluster, a kubeconfig elsewhere.
"""
from __future__ import annotations

import asyncio
import json
import logging
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
import kubernetes

from kaon_operator import api
from kaon_operator.router.endpoints import ENGINE_POD_SELECTOR, EndpointTable

logger = logging.getLogger("kaon.router.watch")

WATCH_SECONDS = 300  # the apiserver ends each watch after this long; the next resumes where it left off
RETRY_SECONDS = 2.0
MISSING_RETRY_SECONDS = 30.0
MAX_OBJECT_BYTES = 16 << 20  # one watch event is one line of JSON


@dataclass(frozen=True, slots=True)
class ApiServer:
    url: str
    ssl: ssl.SSLContext
    authorization: Callable[[], str | None]
    """Called for every request: in-cluster tokens rotate, and the client re-reads them."""

    @classmethod
    def from_environment(cls, kubeconfig: str | None = None) -> ApiServer:
        """The pod's ServiceAccount in a cluster; else `kubeconfig`, $KUBECONFIG or ~/.kube/config."""
        config = kubernetes.client.Configuration()
        try:
            if kubeconfig is None:
                try:
                    kubernetes.config.load_incluster_config(client_configuration=config)
                except kubernetes.config.ConfigException:
                    kubernetes.config.load_kube_config(client_configuration=config)
            else:
                kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
        except (kubernetes.config.ConfigException, OSError) as exc:
            raise NoCredentials(f"no Kubernetes credentials: {exc}") from None
        context = ssl.create_default_context(cafile=config.ssl_ca_cert)
        if not config.verify_ssl:
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        if config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        return cls(config.host, context, lambda: config.get_api_key_with_prefix("BearerToken", alias="authorization"))

    def headers(self) -> dict[str, str]:
        token = self.authorization()
        return {"Authorization": token} if token else {}


@dataclass(frozen=True, slots=True)
class _Kind:
    prefix: str
    plural: str
    selector: str | None
    apply: Callable[[str, dict], None]
    replace: Callable[[str | None, list[dict]], None]
    required: bool = True
    """Whether the table is `synced` only once this kind was listed (InferenceRoutes are not: a cluster
    without their CRD still routes its InferenceServices)."""

    def url(self, server: str, namespace: str | None) -> str:
        scope = f"/namespaces/{namespace}" if namespace else ""
        return f"{server}{self.prefix}{scope}/{self.plural}"


class _Expired(Exception):
    """410 Gone: the resource version is too old to resume from; list again."""


class _Missing(Exception):
    """404 on the list of an optional kind (InferenceRoute without its CRD)."""


class ApiError(Exception):
    pass


class NoCredentials(Exception):
    pass


class Watcher:
    def __init__(self, server: ApiServer, table: EndpointTable, namespaces: Sequence[str] = (), routes=None):
        """`routes`: a routes.table.RouteTable to keep in step with the InferenceRoutes too."""
        self.server = server
        self.table = table
        self.namespaces = tuple(namespaces) or (None,)
        self.kinds: tuple[_Kind, ...] = (
            _Kind("/api/v1", "pods", ENGINE_POD_SELECTOR, table.apply_pod, table.replace_pods),
            _Kind(f"/apis/{api.GROUP}/{api.VERSION}", api.PLURAL, None, table.apply_service, table.replace_services),
        )
        if routes is not None:
            self.kinds += (_Kind(f"/apis/{api.GROUP}/{api.VERSION}", "inferenceroutes", None, routes.apply_route,
                                 routes.replace_routes, required=False),)

    async def run(self) -> None:
        """Follow every (kind, namespace) until cancelled; the table is `synced` once all were listed."""
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.server.ssl)) as session:
            streams = [(kind, ns, asyncio.Event()) for kind in self.kinds for ns in self.namespaces]
            tasks = [asyncio.create_task(self._follow(session, *stream)) for stream in streams]
            try:
                for kind, _, listed in streams:
                    if kind.required:
                        await listed.wait()
                self.table.synced = True
                logger.info("endpoint table synced: %d served names", len(self.table.services()))
                await asyncio.gather(*tasks)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)

    async def _follow(self, session: aiohttp.ClientSession, kind: _Kind, namespace: str | None,
                      listed: asyncio.Event) -> None:
        url = kind.url(self.server.url, namespace)
        missing_logged = False
        while True:
            try:
                version = await self._list(session, kind, namespace, url)
                listed.set()
                while True:
                    version = await self._watch(session, kind, url, version)
            except _Expired:
                logger.info("%s: resource version expired; listing again", url)
            except _Missing:  # an optional kind whose CRD is not installed: look again now and then
                if not missing_logged:
                    logger.info("%s: not served (its CRD is not installed); looking again every %gs", url,
                                MISSING_RETRY_SECONDS)
                    missing_logged = True
                await asyncio.sleep(MISSING_RETRY_SECONDS)
            except (aiohttp.ClientError, TimeoutError, ApiError, ValueError) as exc:
                logger.warning("%s: %s; retrying in %gs", url, exc or type(exc).__name__, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)
            except Exception:  # a stopped watch would leave the table stale for good: never stop
                logger.exception("%s: unexpected error; retrying in %gs", url, RETRY_SECONDS)
                await asyncio.sleep(RETRY_SECONDS)

    def _params(self, kind: _Kind, **more) -> dict[str, str]:
        return {**({"labelSelector": kind.selector} if kind.selector else {}), **more}

    async def _list(self, session: aiohttp.ClientSession, kind: _Kind, namespace: str | None, url: str) -> str:
        async with session.get(url, params=self._params(kind), headers=self.server.headers()) as resp:
            if resp.status == 404 and not kind.required:
                raise _Missing
            if resp.status != 200:
                raise ApiError(f"list: {resp.status} {await resp.text()}")
            body = await resp.json()
        kind.replace(namespace, body["items"])
        return body["metadata"]["resourceVersion"]

    async def _watch(self, session: aiohttp.ClientSession, kind: _Kind, url: str, version: str) -> str:
        """One watch from `version` until the apiserver ends it; returns the last version seen."""
        params = self._params(kind, watch="1", resourceVersion=version, allowWatchBookmarks="true",
                              timeoutSeconds=str(WATCH_SECONDS))
        # No read timeout of its own: bookmarks arrive about once a minute, and the apiserver
        # ends the watch after WATCH_SECONDS; a dead connection is noticed by the margin.
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_SECONDS + 30)
        async with session.get(url, params=params, headers=self.server.headers(), timeout=timeout) as resp:
            if resp.status == 410:
                raise _Expired
            if resp.status != 200:
                raise ApiError(f"watch: {resp.status} {await resp.text()}")
            while line := await resp.content.readuntil(b"\n", max_size=MAX_OBJECT_BYTES):
                if line.strip():
                    version = self._handle(kind, json.loads(line), version)
        return version

    @staticmethod
    def _handle(kind: _Kind, event: dict, version: str) -> str:
        type_, obj = event["type"], event["object"]
        if type_ == "ERROR":
            if obj.get("code") == 410:
                raise _Expired
            raise ApiError(f"watch: {obj.get('code')} {obj.get('message')}")
        if type_ != "BOOKMARK":
            kind.apply(type_, obj)
        return obj["metadata"]["resourceVersion"]
