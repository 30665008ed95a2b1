"""The HTTP edge: an aiohttp server that forwards OpenAI requests to engine pods.

Per request: read the body, take `model` from it, find the InferenceService serving that
name, hold the request while the service has no ready pod, pick a pod (the fewest
requests in flight, or with prefix-affinity the one caching the prompt's prefix within a
load bound: affinity.py), and relay the response as it arrives (SSE streams chunk by chunk),
with the engine's status, headers and body unchanged.

Failures: an attempt that fails before the response began (refused or reset connection, the
engine closing it, no response headers within --first-byte-timeout) goes to another pod, up to
--max-attempts; the last failure is the answer (502, or 504 for a timeout). After the response
began nothing is repeated: a stream that breaks off or sends nothing for --idle-timeout ends with
an OpenAI error event (an unfinished body when it is not a stream). Either way the pod is
ejected (balance.Backoff) so the next requests go elsewhere.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

from kaon_operator.router import affinity, auth, errors
from kaon_operator.router.balance import Backoff, candidates, pick
from kaon_operator.router.endpoints import Endpoint, EndpointTable, ServiceKey
from kaon_operator.router.errors import RouterError
from kaon_operator.router.hold import Hold, HoldFull
from kaon_operator.router.metrics import RouterMetrics

logger = logging.getLogger("kaon.router")

HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                        "trailers", "transfer-encoding", "upgrade"})
# The body is already read (and any 100-continue answered); aiohttp sets the length itself.
NOT_FORWARDED = HOP_BY_HOP | {"host", "content-length", "expect"}
# Headers aiohttp's client would add on its own; the engine gets the client's, or none.
NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# The engine (uvicorn) closes idle keep-alive connections after 5 s. A request sent on a
# connection it is closing fails after it went out, which is not safe to retry: stay under.
UPSTREAM_KEEPALIVE_S = 4.0
# Errors raised before a single byte of the request was sent.
CONNECT_ERRORS = (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)
# Where a server-sent event ends; the router passes only whole events on, so that an error
# event after a break is never glued to half an event.
SSE_ENDS = (b"\n\n", b"\r\n\r\n")
MAX_PENDING_SSE = 1 << 16  # an event longer than this is passed on in pieces after all
WHOLE_BODY_BYTES = 1 << 16  # a body of known length up to this is read whole, then sent in one write


@dataclass(frozen=True, slots=True)
class RouterConfig:
    queue_timeout: float = 60.0
    """Seconds a request waits for a ready pod of its InferenceService before a 503."""
    max_queued: int = 100
    """Requests that may wait per InferenceService; more get a 503 at once."""
    backoff: float = 5.0
    """Seconds a pod that failed to connect gets no new requests (unless no other pod is left)."""
    connect_timeout: float = 3.0
    first_byte_timeout: float = 600.0
    """Seconds from sending a request to the engine's response headers. A request without
    `stream` gets its headers only with the whole completion, so this bounds the longest one."""
    idle_timeout: float = 300.0
    """Seconds a response (a stream) may go without sending anything once it began."""
    max_attempts: int = 3
    """Pods one request tries when attempts fail before a response began."""
    max_body_bytes: int = 4 << 20  # the engine's own default limit


def requested_model(body: bytes) -> str:
    """The `model` field of an OpenAI request body."""
    return parse_request(body)[0]


def parse_request(body: bytes) -> tuple[str, dict]:
    """The `model` field of an OpenAI request body, and the body."""
    try:
        payload = json.loads(body)
    except ValueError as exc:
        raise errors.bad_request(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise errors.bad_request("the request body must be a JSON object")
    model = payload.get("model")
    if not isinstance(model, str) or not model:
        raise errors.bad_request("`model` is required and must be a string", param="model")
    return model, payload


IDLE = "idle"


def _last_event_end(data: bytes) -> int:
    """Where the last whole server-sent event in `data` ends (0: none)."""
    return max(data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0,
               data.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in data else 0)


def _forwarded(headers) -> CIMultiDict:
    return CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in NOT_FORWARDED)


class Router:
    """The gateway's state (in-flight counts, back-offs, held requests) and its aiohttp app."""

    def __init__(self, table: EndpointTable, config: RouterConfig = RouterConfig(), rng: random.Random | None = None):
        self.table = table
        self.config = config
        self.rng = rng or random.Random()
        self.inflight: dict[Endpoint, int] = {}
        self.backoff = Backoff(config.backoff)
        self.hold = Hold(config.max_queued)
        self.known = affinity.KnownPrefixes()
        """Where prefix-affinity sent each prompt chunk lately."""
        self._rings: dict[ServiceKey, affinity.Ring[Endpoint]] = {}
        self.homes = affinity.Homes()
        """Which pod each conversation prefix-affinity routed went to, while it is active."""
        table.on_change = self._changed
        self.metrics = RouterMetrics(table, self.inflight, self.held, lambda: self.backoff.ejected(time.monotonic()))
        self._session: aiohttp.ClientSession | None = None

    def _changed(self, key: ServiceKey) -> None:
        """The watch changed a service's ready pods: held requests look again, and a pod that
        left the ready set is no longer ejected (when it is back, it was seen ready anew)."""
        self.hold.notify(key)
        if self.backoff.failures:
            self.backoff.keep_only(lambda e: e in self.table.endpoints(ServiceKey(e.namespace, e.service)))

    def held(self) -> dict[ServiceKey, int]:
        """Requests waiting per InferenceService because it has no ready pod: the autoscaler's
        scale-from-zero signal (also the `kaon_router_held_requests` gauge)."""
        return self.hold.held()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        app.router.add_post("/v1/{tail:.+}", self._forward)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.cleanup_ctx.append(self._upstream_session)
        return app

    async def _upstream_session(self, app: web.Application):
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=NO_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to the next
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout))
        yield
        await self._session.close()

    # forwarding ----------------------------------------------------------------

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        arrival = time.perf_counter()
        key: ServiceKey | None = None
        relaying = False  # from then on the engine's status is the one counted
        try:
            try:
                body = await request.read()
            except web.HTTPRequestEntityTooLarge:
                raise errors.too_large(self.config.max_body_bytes) from None
            model, payload = parse_request(body)
            body = self._admit(request, model, payload, body)
            received = time.monotonic()
            tried: set[Endpoint] = set()
            held = 0.0
            failure: RouterError | None = None  # the last attempt's, which answers when none is left
            while len(tried) < max(1, self.config.max_attempts):  # 0 would answer nothing
                try:
                    key, target, waited = await self._choose(model, tried, received, request.path, payload)
                except RouterError as exc:
                    if failure is not None and exc.code == "upstream_unreachable":
                        raise failure from None  # every ready pod was tried
                    raise
                held += waited
                dispatched = time.perf_counter()
                upstream = await self._send(request, body, key, target, tried)
                if isinstance(upstream, RouterError):
                    failure = upstream
                    continue
                relaying = True
                return await self._relay(request, upstream, key, target, dispatched - arrival - held)
            raise failure
        except RouterError as exc:
            self._count(key, exc.status)
            return exc.response()
        except asyncio.CancelledError:
            if not relaying:
                self._count(key, 499)  # the client went away first (nginx's code for it)
            raise

    def _admit(self, request: web.Request, model: str, payload: dict, body: bytes) -> bytes:
        """Check the API key of the InferenceService `model` names (before the request may wait
        for a replica: an unauthenticated one must not wake a service from zero), and the body to
        send: with `model` rewritten to the served name when the client addressed it otherwise
        (`namespace/name`), since the engine answers only that. The JSON is rebuilt only then."""
        key = self.table.resolve(model)
        if key is None:
            return body  # _choose answers 404, or 503 while the router starts
        auth.check(self.table, key, request.headers.get("Authorization"))
        service = self.table.service(key)
        if service is None or service.served_name == model:
            return body
        payload["model"] = service.served_name
        return json.dumps(payload, ensure_ascii=False).encode()

    def _count(self, key: ServiceKey | None, status: int) -> None:
        self.metrics.requests.labels(*(key or ("", "")), str(status)).inc()

    async def _choose(self, model: str, tried: set[Endpoint], received: float, path: str = "",
                      payload: dict | None = None) -> tuple[ServiceKey, Endpoint, float]:
        """The service and pod for this attempt, and how long the request was held for it."""
        held_since, was_held = time.monotonic(), False
        while True:
            key = self.table.resolve(model)
            if key is None:
                raise errors.model_not_found(model) if self.table.synced else errors.starting()
            # An autoscaled service at zero waits for a cold start: it may hold longer than the default.
            limit = max(self.config.queue_timeout, self.table.hold_seconds(key) or 0.0)
            deadline = received + limit
            ready = self.table.endpoints(key)
            now = time.monotonic()
            usable = candidates(ready, tried, self.backoff.until, now)
            if usable:
                if was_held:
                    self.metrics.held_seconds.labels(*key).observe(now - held_since)
                return key, self._pick(key, ready, usable, path, payload or {}), now - held_since
            if ready:  # every ready pod was tried by this request
                raise errors.upstream_unreachable(str(key), len(tried))
            if now >= deadline:
                raise errors.no_ready_replica(model, str(key), limit)
            was_held = True
            try:
                await self.hold.wait(key, deadline - now)
            except HoldFull:
                raise errors.queue_full(model, str(key), self.config.max_queued) from None

    def _pick(self, key: ServiceKey, ready: tuple[Endpoint, ...], usable: list[Endpoint], path: str,
              payload: dict) -> Endpoint:
        """By the service's routing strategy; least connections when it has none or the
        request has no prompt to go by."""
        service = self.table.service(key)
        prefix = affinity.prefix(path, payload, str(key)) if service and service.strategy == "prefix-affinity" else None
        if prefix is None:
            return pick(usable, self.inflight, self.rng)
        ring = self._rings.get(key)
        if ring is None or ring.members != ready:
            self._rings = {k: r for k, r in self._rings.items() if self.table.endpoints(k)}  # forget gone services
            ring = self._rings[key] = affinity.Ring(ready, name=lambda e: e.pod)
        order = [e for e in ring.walk(prefix.anchor) if e in usable]
        now = time.monotonic()
        own = prefix.hashes[prefix.own_from:]
        first = (affinity.preferred(own, self.known, order, self.inflight, rng=self.rng)
                 or self.homes.home(prefix.anchor, now))
        target, hit = affinity.choose(order, usable, self.inflight, service.load_bound, first, service.max_num_seqs,
                                      self.homes.counts(now), rng=self.rng,
                                      popular=len(affinity.holders(own, self.known, order)) > 1)
        (self.metrics.affinity_hits if hit else self.metrics.affinity_overrides).labels(*key).inc()
        self.known.record(prefix.hashes, target)
        self.homes.touch(prefix.anchor, target, now)
        return target

    async def _send(self, request: web.Request, body: bytes, key: ServiceKey, target: Endpoint,
                    tried: set[Endpoint]) -> aiohttp.ClientResponse | RouterError:
        """The upstream response (headers read), or the error when the attempt failed before
        the response began: nothing reached the client yet, so the caller may try another pod.
        (An engine that failed part way through a request has produced nothing the client saw;
        repeating the request elsewhere costs compute, never a duplicated answer.)"""
        self.inflight[target] = self.inflight.get(target, 0) + 1
        try:
            async with asyncio.timeout(self.config.first_byte_timeout):
                return await self._session.request(
                    request.method, target.url + request.path_qs, data=body, headers=_forwarded(request.headers),
                    allow_redirects=False)
        except CONNECT_ERRORS as exc:  # before TimeoutError: a connect timeout is one too
            reason, error = f"cannot connect ({exc})", None
        except TimeoutError:
            self.metrics.timeouts.labels(*key, "first_byte").inc()
            reason = f"no response within {self.config.first_byte_timeout:g}s"
            error = errors.upstream_timeout(str(key), target.pod, "response", self.config.first_byte_timeout,
                                            len(tried) + 1)
        except aiohttp.ClientError as exc:
            reason = str(exc) or type(exc).__name__
            error = errors.upstream_failed(str(key), target.pod, reason)
        except BaseException:
            self._release(target)
            raise
        self._release(target)
        tried.add(target)
        self.metrics.retries.labels(*key).inc()
        self._eject(key, target, reason)
        return error or errors.upstream_unreachable(str(key), len(tried))

    def _eject(self, key: ServiceKey, target: Endpoint, reason: str) -> None:
        now = time.monotonic()
        was_out = self.backoff.until.get(target, 0.0) > now
        seconds = self.backoff.fail(target, now)
        self.metrics.ejections.labels(*key).inc()
        if not was_out:  # one line per ejection, not one per request that failed during it (an overload)
            logger.warning("%s/%s: %s; ejected for %gs", target.namespace, target.pod, reason, seconds)

    def _release(self, target: Endpoint) -> None:
        left = self.inflight[target] - 1
        if left:
            self.inflight[target] = left
        else:
            del self.inflight[target]

    async def _relay(self, request: web.Request, upstream: aiohttp.ClientResponse, key: ServiceKey,
                     target: Endpoint, overhead: float) -> web.StreamResponse:
        try:
            async with upstream:  # releases the connection, or closes it when the body was not read to the end
                received = time.perf_counter()
                headers = CIMultiDict((k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP)
                sse = upstream.content_type == "text/event-stream"
                length = upstream.content_length
                if not sse and length is not None and length <= WHOLE_BODY_BYTES:
                    return await self._relay_whole(upstream, key, target, headers, overhead, received)
                response = web.StreamResponse(status=upstream.status, reason=upstream.reason, headers=headers)
                await response.prepare(request)
                self.metrics.added_latency.observe(overhead + time.perf_counter() - received)
                self._count(key, upstream.status)
                self.backoff.succeed(target)
                try:
                    broke_off = await self._pump(upstream, response, sse)
                    if broke_off is None:
                        await response.write_eof()
                        return response
                except ConnectionResetError:  # the client went away; closing the upstream aborts the request
                    return response
                if broke_off is IDLE:
                    self.metrics.timeouts.labels(*key, "idle").inc()
                    broke_off = f"nothing sent for {self.config.idle_timeout:g}s"
                    error = errors.upstream_timeout(str(key), target.pod, "data", self.config.idle_timeout)
                else:
                    error = errors.upstream_broke_off(str(key), target.pod, broke_off)
                self.metrics.broken.labels(*key).inc()
                self._eject(key, target, f"response broke off: {broke_off}")
                await self._end_broken(request, response, error, sse)
                return response
        finally:
            self._release(target)

    async def _relay_whole(self, upstream: aiohttp.ClientResponse, key: ServiceKey, target: Endpoint,
                           headers: CIMultiDict, overhead: float, received: float) -> web.Response:
        """A small body of known length (a completion without `stream`, an error) is read whole
        and sent with the headers in one write: one system call fewer per request than
        streaming it, and a failure while reading it can still be the router's own 502/504."""
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.config.idle_timeout):
                body = await upstream.read()
            read = time.perf_counter()
        except TimeoutError:
            self.metrics.timeouts.labels(*key, "idle").inc()
            self._eject(key, target, f"response broke off: nothing sent for {self.config.idle_timeout:g}s")
            raise errors.upstream_timeout(str(key), target.pod, "data", self.config.idle_timeout) from None
        except aiohttp.ClientError as exc:
            reason = str(exc) or type(exc).__name__
            self._eject(key, target, f"response broke off: {reason}")
            raise errors.upstream_broke_off(str(key), target.pod, reason) from None
        del headers["Content-Length"]  # the Response sets it
        response = web.Response(status=upstream.status, reason=upstream.reason, headers=headers, body=body)
        # The router's part only: not the time the engine took to send the body.
        self.metrics.added_latency.observe(overhead + started - received + time.perf_counter() - read)
        self._count(key, upstream.status)
        self.backoff.succeed(target)
        return response

    @staticmethod
    async def _end_broken(request: web.Request, response: web.StreamResponse, error: RouterError, sse: bool) -> None:
        """Headers are out, so the status cannot say it. A stream ends with an error event as
        OpenAI's does (its clients raise it); any other body is left unfinished, which clients
        see as a broken response rather than a short, valid-looking one."""
        if sse:
            try:
                await response.write(errors.stream_event(error))
                await response.write_eof()
                return
            except ConnectionResetError:
                pass
        if request.transport is not None:
            request.transport.close()

    async def _pump(self, upstream: aiohttp.ClientResponse, response: web.StreamResponse, sse: bool) -> str | None:
        """Copy the body as it arrives. None at its end; else why it broke off (IDLE: nothing
        came for --idle-timeout). A stream is passed on in whole events."""
        loop = asyncio.get_running_loop()
        idle = self.config.idle_timeout
        content = upstream.content
        pending = b""  # the start of an event whose end has not come yet
        last = loop.time()  # when the engine last sent something, or the client last took it
        writing = False
        while True:
            # One timer per idle period rather than one per chunk (rescheduling a timer costs
            # about a tenth of relaying a chunk): when it fires, the stream is idle only if
            # nothing came since `last`; else it is set again from `last`.
            try:
                async with asyncio.timeout_at(last + idle):
                    while True:
                        try:
                            chunk = await content.readany()
                        except aiohttp.ClientError as exc:
                            return str(exc) or type(exc).__name__
                        last = loop.time()
                        if not chunk:
                            if pending:
                                chunk, pending = pending, b""
                                writing = True
                                await response.write(chunk)
                            return None
                        if sse:
                            if pending:
                                chunk, pending = pending + chunk, b""
                            if not chunk.endswith(SSE_ENDS):
                                cut = _last_event_end(chunk)
                                if len(chunk) - cut < MAX_PENDING_SSE:
                                    chunk, pending = chunk[:cut], chunk[cut:]
                                if not chunk:
                                    continue
                        # A slow client is not an idle engine: the time a write waits for the
                        # client to read never counts. (A timer firing in the write stops only
                        # its wait for the client; the chunk is already queued.)
                        writing = True
                        await response.write(chunk)
                        writing = False
                        last = loop.time()
            except TimeoutError:
                if not writing and loop.time() - last >= idle:
                    return IDLE
                if writing and not pending and content.at_eof():
                    return None  # the timer fired in the last write
                writing, last = False, loop.time()

    # the router's own endpoints --------------------------------------------------

    async def _models(self, request: web.Request) -> web.Response:
        # What this client may send as `model`: every addressable name, but a protected
        # InferenceService only to a caller with one of its keys.
        authorization = request.headers.get("Authorization")
        data = [{"id": name, "object": "model", "created": s.created, "owned_by": "kaon"}
                for name, s in self.table.addressable() if auth.may_list(self.table, s.key, authorization)]
        return web.json_response({"object": "list", "data": data})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok" if self.table.synced else "starting"},
                                 status=200 if self.table.synced else 503)

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": "text/plain; version=0.0.4"})
