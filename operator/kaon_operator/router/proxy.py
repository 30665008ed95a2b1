"""The HTTP edge: an aiohttp server that forwards OpenAI requests to engine pods.

Only the engine's OpenAI routes are forwarded (CLIENT_ROUTES); anything else is OpenAI's 404.
Per request: decide on the headers whether to read the body at all (a key that opens nothing,
the bytes already held, this client's share of them: admission.py), read it within
--body-timeout, scan it and take what parsing it costs from the same budget (json_cost.py), take
`model` from it (request.py), find the InferenceService serving that name (naming.py: one
reading only), check its key again at each attempt, hold the request while the service
has no ready pod (hold.py), pick a pod by the service's routing strategy (strategies/), and
relay the response as it arrives (relay.py; SSE streams in whole events, sse.py), with the
engine's status, headers and body unchanged. A pod gets none of the client's credentials but
a keyed service's own key (request.upstream_headers). The listening socket's own limits (connections,
request heads) are edge.py's.

Failures (every rule for sending again: retry.py): an attempt that fails before the response
began (refused or reset connection, the engine closing it, no response headers within
--first-byte-timeout) goes to another pod, up to --max-attempts; the last failure is the answer
(502, or 504 for a timeout). After the response began nothing is repeated: a stream that breaks
off or sends nothing for --idle-timeout ends with an OpenAI error event (an unfinished body when
it is not a stream). Either way the pod is ejected (backoff.Backoff) so the next requests go elsewhere.

Over 300 lines for a stated reason: one request's whole path (admit, read, choose, send,
release) reads top to bottom in one class, beside the router's own small endpoints that read
the same state (in-flight counts, the table, the metrics).
"""
from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence
from typing import Any

import aiohttp
from aiohttp import web

from kaon_operator import clock
from kaon_operator.router import auth, errors, json_cost, pressure as pressure_report, retry
from kaon_operator.router.admission import BodyBudget, body_size, source_of
from kaon_operator.router.backoff import Backoff, candidates
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import Endpoint, EndpointTable, ServiceKey
from kaon_operator.router.errors import RouterError
from kaon_operator.router.fast import Exchange
from kaon_operator.router.front import FRONT, Front, FrontRequest, Whole, authorization
from kaon_operator.router.hold import Hold, HoldFull
from kaon_operator.router.metrics import Phase, RouterMetrics
from kaon_operator.router.relay import Relay
from kaon_operator.router.request import engine_body, parse_request, upstream_fields
from kaon_operator.router.strategies import Attempt, Strategies
from kaon_operator.router.strategies.least_connections import LEAST_CONNECTIONS, pick
from kaon_operator.router.upstream import UPSTREAM_KEEPALIVE_S, ConnectFailed, Pool, Response, UpstreamError

logger = logging.getLogger("kaon.router")

Incoming = web.Request | FrontRequest
"""What a handler is given: the router's own server's request on the main port (front.py), aiohttp's elsewhere
(the admin port, aiohttp's test server). Said in full: compiled (compiled.py), mypyc checks the annotation."""

# Headers aiohttp's client would add on its own; the engine gets the client's, or none.
NO_AUTO_HEADERS = ("User-Agent", "Accept", "Accept-Encoding", "Content-Type")
# What a client may ask of an engine through the router: the engine's OpenAI routes
# (runtime/kaon_runtime/server/app.py). Not its admin routes (/v1/load_lora_adapter,
# /v1/unload_lora_adapter: the operator reaches pods directly), nor any route the engine may add
# later until it is listed here. /tokenize and /detokenize are left out while the engine admits
# them outside the generation queue (issue 48, item 4).
CLIENT_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
# Errors raised before a single byte of the request was sent.
ASLEEP_HEADER = "Kaon-Engine-Asleep"  # on an engine's 503 while asleep (kaon_runtime server/sleep.py)


class Router:
    """The gateway's state (in-flight counts, back-offs, held requests) and its aiohttp app."""

    def __init__(self, table: EndpointTable, config: RouterConfig | None = None, rng: random.Random | None = None):
        self.table = table
        self.config = config = config or RouterConfig()
        self.rng = rng or random.Random()
        self.inflight: dict[Endpoint, int] = {}
        self.backoff: Backoff[Endpoint] = Backoff(config.backoff)
        self.hold = Hold(config.max_queued)
        self.budget = BodyBudget(config.max_buffered_bytes, config.max_client_share)
        self.strategies = Strategies()
        self.routes: Any = None
        """router.route_gateway.RouteGateway when InferenceRoutes are watched (main.py): a `model` naming a route goes
        through it (tier, cache) and on as its tier's request."""
        table.on_change = self._changed
        self.metrics = RouterMetrics(table, self.inflight, self.held, lambda: self.backoff.ejected(clock.monotonic()))
        self.relay = Relay(config.idle_timeout, config.write_timeout, self.metrics, self.backoff, self._eject)
        self._session: aiohttp.ClientSession  # made when the app starts: the routes' own requests (route_gateway.call)
        self.upstream: Pool  # made when the app starts: the clients' requests to the engines (upstream.py)
        self.answered_now = 0
        """Answers the fast path wrote from the engine's callback (fast.py): the tests' view of which path ran."""

    def _changed(self, key: ServiceKey) -> None:
        """The watch changed a service's ready pods: held requests look again; a pod that left
        the ready set is no longer ejected (when it is back, it was seen ready anew); the
        strategies forget a service with no ready pod left."""
        self.hold.notify(key)
        if not self.table.endpoints(key):
            self.strategies.forget(key)
        if self.backoff.failures:
            self.backoff.keep_only(lambda e: e in self.table.endpoints(ServiceKey(e.namespace, e.service)))

    def held(self) -> dict[ServiceKey, int]:
        """Requests waiting per InferenceService because it has no ready pod: the autoscaler's
        scale-from-zero signal (also the `kaon_router_held_requests` gauge)."""
        return self.hold.held()

    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body_bytes)
        for path in CLIENT_ROUTES:
            app.router.add_post(path, self._forward)  # type: ignore[arg-type]  # (a Whole answers our server only)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_route("*", "/{tail:.*}", self._unknown)  # last: what no route above takes
        # Two callbacks, not a cleanup context: mypyc (compiled.py) does not compile an async generator.
        app.on_startup.append(self._open_upstream)
        app.on_cleanup.append(self._close_upstream)
        app[FRONT] = self.front  # edge.serving serves the same routes with the router's own server (front.py)
        return app

    def front(self, header_timeout: float) -> Front:
        """The router's own HTTP server for its main port (front.py): the routes of app()."""
        routes: dict[tuple[str, str], Any] = {("POST", path): self._forward for path in CLIENT_ROUTES}
        routes.update({("GET", "/v1/models"): self._models, ("GET", "/health"): self._health,
                       ("GET", "/ready"): self._ready, ("GET", "/metrics"): self._metrics})
        return Front(routes, self._unknown, self.config.max_body_bytes, header_timeout,
                     {("POST", path): self._forward_now for path in CLIENT_ROUTES})

    async def _open_upstream(self, app: web.Application) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=UPSTREAM_KEEPALIVE_S)
        self._session = aiohttp.ClientSession(
            connector=connector, auto_decompress=False, skip_auto_headers=NO_AUTO_HEADERS,
            cookie_jar=aiohttp.DummyCookieJar(),  # never carry one client's cookies to the next
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout))
        self.upstream = Pool(self.config.connect_timeout)

    async def _close_upstream(self, app: web.Application) -> None:
        self.upstream.close()
        await self._session.close()

    # forwarding ----------------------------------------------------------------

    def _forward_now(self, request: FrontRequest) -> bool:
        """The common case of _forward without a coroutine (fast.py), decided before anything is done that cannot be
        undone: the whole body in, no pod ejected, no InferenceRoute named, the service resolved with a ready pod. Then
        the pod is picked, and the request goes out from this callback on a kept connection to it (fast.Exchange
        answers from the engine's), or, with none kept, on through _forward's coroutine from there (it connects); a
        refusal is answered at once. False (the budget given back): _forward's coroutine takes the request from the
        start."""
        body = request.body_now()
        if body is None or self.backoff.until:
            return False
        arrival = time.perf_counter()
        source = source_of(request.remote)
        reserved = 0
        read = False
        try:
            reserved = self._reserve(request, source)
            read = True
            reserved += self._parse_cost(body, reserved, source)
            model, payload = parse_request(body)
            if self.routes is None or self.routes.match(model) is None:
                body, admitted = self._admit(request, model, payload, body)
                if admitted is not None and (ready := self.table.endpoints(admitted)):
                    target = self._pick(admitted, ready, ready, request.path, payload)
                    self._start_now(request, admitted, target, model, payload, body, reserved, source, arrival)
                    return True
        except RouterError as exc:  # as _forward answers one raised before the first attempt
            self.budget.release(reserved, source)
            self.metrics.count(None, exc.status)
            response = exc.response()
            if not read:
                response.force_close()
            request.conn.answer_now(request, response)
            return True
        except BaseException:  # (a bug: the front answers 500; nothing of the request is kept)
            self.budget.release(reserved, source)
            raise
        self.budget.release(reserved, source)
        return False

    def _start_now(self, request: FrontRequest, key: ServiceKey, target: Endpoint, model: str, payload: dict,
                   body: bytes, reserved: int, source: str, arrival: float) -> None:
        """The fast path's request sent on a kept connection, counted in flight (as _send does); with none kept to the
        pod, handed to the coroutine path, which sends it (_send_resumed)."""
        exchange = Exchange(self, request, key, target, model, payload, body, reserved, source, arrival,
                            clock.monotonic())
        request.conn.exchange = exchange  # (the client gone before the coroutine path began on it: abandon)
        exchange.dispatched = time.perf_counter()
        if not self.upstream.has_idle(target.url, self.upstream.loop_time()):
            exchange.hand_over()
            return
        exchange.sent = True
        self.inflight[target] = self.inflight.get(target, 0) + 1
        exchange.data, exchange.deadline = self.upstream.send_now(
            target.url, request.method, _engine_path(request), self._fields(request, key), body,
            self.config.first_byte_timeout, exchange)

    async def _forward(self, request: Incoming, resumed: Exchange | None = None) -> web.StreamResponse | Whole:
        """`resumed`: a request the fast path (_forward_now) sent, handed over (fast.Exchange.hand_over) where it
        stands: its first attempt's outcome is taken as _send's would be, and the rest is as for any request."""
        arrival = time.perf_counter() if resumed is None else resumed.arrival
        key: ServiceKey | None = None
        relaying = False  # from then on the engine's status is the one counted
        reserved = 0  # bytes taken from the budget: the body's, then what parsing it costs
        source = source_of(request.remote) if resumed is None else resumed.source
        read = False  # a refusal before the body was read closes the connection rather than read it
        plan = None  # an InferenceRoute's plan (router/route_gateway.py), when `model` names a route
        if resumed is not None:
            resumed.taken = True  # (before any await: the client's going ends it through this coroutine from now)
            reserved, read = resumed.reserved, True
        try:
            try:
                if resumed is None:
                    reserved = self._reserve(request, source)
                    body = request.body_now() if isinstance(request, FrontRequest) else None
                    if body is None:  # (None: not all of it is in yet, or it is refused: _read waits, or raises why)
                        body = await self._read(request)
                    read = True
                    reserved += self._parse_cost(body, reserved, source)
                    model, payload = parse_request(body)
                    if self.routes is not None and (route := self.routes.match(model)) is not None:
                        plan = await self.routes.plan(route, _route_path(request), payload,
                                                      authorization(request))
                        if not hasattr(plan, "model"):  # a cache hit: no engine is asked
                            return await self.routes.replay(request, plan)
                        model, payload, body = plan.model, plan.payload, plan.body
                    body, admitted = self._admit(request, model, payload, body)
                    received = clock.monotonic()
                else:  # admitted, picked and sent by _forward_now
                    model, payload, body, admitted, received = (resumed.model, resumed.payload, resumed.body, None,
                                                                resumed.received)
                tried: set[Endpoint] = set()
                held = 0.0
                failure: RouterError | None = None  # the last attempt's, which answers when none is left
                while retry.may_try_another(len(tried), self.config.max_attempts):  # retry.py
                    if resumed is not None:  # the fast path's attempt: its outcome, as _send's
                        key, target, dispatched = resumed.key, resumed.target, resumed.dispatched
                        upstream = await self._send_resumed(request, resumed, tried)
                        resumed = None
                    else:
                        try:
                            if (first := self._first_choice(admitted, tried, request.path, payload)) is not None:
                                key, target, waited = *first, 0.0  # the common case, without _choose's coroutine
                            else:
                                key, target, waited = await self._choose(model, tried, received, request.path,
                                                                        payload, authorization(request), admitted)
                            admitted = None  # a later attempt follows an await: `model` is resolved and checked anew
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
                    if _asleep(upstream):
                        # A standby the operator just put to sleep stays Ready until its readiness probe
                        # fails (seconds): it answered nothing, so another pod may take the request.
                        self._release(target)
                        tried.add(target)
                        self._eject(key, target, "asleep (a standby replica)")
                        failure = errors.replicas_asleep(str(key), len(tried))
                        continue
                    relaying = True
                    try:
                        overhead = dispatched - arrival - held
                        if plan is None and (whole := self.relay.whole_now(request, upstream, key, target,
                                                                          overhead)) is not None:
                            return whole  # the common answer, without the relay's coroutine
                        return await self.relay(request, upstream, key, target, overhead, plan)
                    finally:
                        self._release(target)
                        if plan is not None:
                            await self.routes.finish(plan)
                assert failure is not None  # every attempt that did not return set it
                raise failure
            except RouterError as exc:
                self.metrics.count(key, exc.status)
                response = exc.response()
                if not read:
                    response.force_close()
                return response
            except asyncio.CancelledError:
                if not relaying:
                    self.metrics.count(key, 499)  # the client went away first (nginx's code for it)
                raise
        finally:
            self.budget.release(reserved, source)

    def _reserve(self, request: Incoming, source: str) -> int:
        """Decide on the headers whether the body is read at all, and take its bytes from the budget:
        a key that opens nothing (while every service needs one), a body over --max-body-bytes, or
        one that does not fit the bytes already held (--max-buffered-bytes, of which this client
        may hold --max-client-share) is refused unread."""
        if not auth.may_send_body(self.table, authorization(request)):
            raise errors.invalid_api_key()
        length = request.content_length
        if length is not None and length > self.config.max_body_bytes:
            raise errors.too_large(self.config.max_body_bytes)
        size = body_size(length, self.config.max_body_bytes)
        if not self.budget.reserve(size, source):
            self.metrics.overloaded.inc()
            raise errors.overloaded("buffered request bodies")
        return size

    def _parse_cost(self, body: bytes, reserved: int, source: str) -> int:
        """Take from the budget what parsing `body` will hold beyond the bytes already reserved
        (json_cost.py), before it is parsed: a body over the JSON limits is a 400/413 naming the
        limit, one that would cost more than a request may hold a 413, one that does not fit now
        a 503."""
        cost, refusal = json_cost.assess(body, self.config.json_limits)
        if refusal is not None:
            status, message = refusal
            raise errors.bad_request(message) if status == 400 else errors.too_costly(message)
        if cost > self.budget.most_one_request():
            raise errors.too_costly(f"parsing the request body would hold about {cost >> 20} MiB, more than the "
                                    f"router lets one request hold ({self.budget.most_one_request() >> 20} MiB)")
        extra = max(0, cost - reserved)
        if not self.budget.reserve(extra, source):
            self.metrics.overloaded.inc()
            raise errors.overloaded("buffered request bodies")
        return extra

    async def _read(self, request: Incoming) -> bytes:
        try:
            if request.content.is_eof():  # the whole body came with the head: nothing to wait for
                return await request.read()
            async with asyncio.timeout(self.config.body_timeout):
                return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise errors.too_large(self.config.max_body_bytes) from None
        except TimeoutError:
            raise errors.request_timeout(self.config.body_timeout) from None

    def _admit(self, request: Incoming, model: str, payload: dict, body: bytes) -> tuple[bytes, ServiceKey | None]:
        """Check the API key of the InferenceService `model` names (before the request may wait
        for a replica: an unauthenticated one must not wake a service from zero); the body to
        send (request.engine_body: `model` as the engine knows it) and the service it was checked for."""
        key = self.table.resolve(model)
        if key is None:
            return body, None  # _choose answers 404, or 503 while the router starts
        auth.check(self.table, key, model, authorization(request))
        service = self.table.service(key)
        if service is None:
            return body, key
        return engine_body(body, payload, model, self.table.engine_model(model, service)), key

    async def _choose(self, model: str, tried: set[Endpoint], received: float, path: str = "",
                      payload: dict | None = None,
                      authorization: str | None = None,
                      admitted: ServiceKey | None = None) -> tuple[ServiceKey, Endpoint, float]:
        """The service and pod for this attempt, and how long the request was held for it. The key
        is checked again for the service `model` names now: while the request was held the name may
        have moved to another one, which must not get this client's key nor its prompt unchecked.
        `admitted`: the service _admit resolved `model` to and checked the key for with no await since
        (the table cannot have changed): not resolved nor checked again before the first wait."""
        held_since, was_held = clock.monotonic(), False
        while True:
            if admitted is not None and not was_held:
                key = admitted
            else:
                found = self.table.resolve(model)
                if found is None:
                    raise errors.model_not_found(model) if self.table.synced else errors.starting()
                key = found
                auth.check(self.table, key, model, authorization)
            # An autoscaled service at zero waits for a cold start: it may hold longer than the default.
            limit = max(self.config.queue_timeout, self.table.hold_seconds(key) or 0.0)
            deadline = received + limit
            ready = self.table.endpoints(key)
            now = clock.monotonic()
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

    def _first_choice(self, admitted: ServiceKey | None, tried: set[Endpoint], path: str,
                      payload: dict | None) -> tuple[ServiceKey, Endpoint] | None:
        """The common case of _choose, decided as its loop would on its first turn: a first attempt (`admitted`: the
        service _admit checked, with no await since) while no pod failed (candidates: every ready pod is usable), to
        a service that has some. None: ask _choose."""
        if admitted is None or tried or self.backoff.until:
            return None
        if ready := self.table.endpoints(admitted):
            return admitted, self._pick(admitted, ready, ready, path, payload or {})
        return None

    def _pick(self, key: ServiceKey, ready: tuple[Endpoint, ...], usable: Sequence[Endpoint], path: str,
              payload: dict) -> Endpoint:
        """By the service's routing strategy (spec.routing.strategy)."""
        service = self.table.service(key)
        if service is None or (service.strategy == LEAST_CONNECTIONS and not service.adapters):
            # Gone since it was resolved; or least-connections with no adapter to keep (what AdapterAffinity and
            # LeastConnections do then, the same draws, without an Attempt and two calls through them).
            return pick(usable, self.inflight, self.rng)
        attempt = Attempt(service, ready, usable, self.inflight, path, payload, clock.monotonic(), self.rng)
        target, first_choice = self.strategies.get(service.strategy).pick(attempt)
        if first_choice is not None:
            (self.metrics.affinity_hits if first_choice else self.metrics.affinity_overrides).labels(*key).inc()
        return target

    async def _send(self, request: Incoming, body: bytes, key: ServiceKey, target: Endpoint,
                    tried: set[Endpoint]) -> Response | RouterError:
        """The upstream response (headers read), or the error when the attempt failed before
        the response began: nothing reached the client yet, so the caller may try another pod.
        (An engine that failed part way through a request has produced nothing the client saw;
        repeating the request elsewhere costs compute, never a duplicated answer.)"""
        self.inflight[target] = self.inflight.get(target, 0) + 1
        try:
            return await self.upstream.request(target.url, request.method, _engine_path(request),
                                               self._fields(request, key), body,
                                               self.config.first_byte_timeout)
        except (TimeoutError, UpstreamError) as exc:  # retry.py, rule 2
            return self._failed_attempt(exc, key, target, tried)
        except BaseException:
            self._release(target)
            raise

    async def _send_resumed(self, request: Incoming, resumed: Exchange,
                            tried: set[Endpoint]) -> Response | RouterError:
        """_send's outcome for the fast path's attempt (fast.py): its response, or its failure as _send takes one
        (Pool.request's: once more on a new connection when the kept one failed unanswered, retry.py rule 1); _send
        itself when it was not sent (no connection to the pod was kept)."""
        key, target = resumed.key, resumed.target
        if not resumed.sent:
            return await self._send(request, resumed.body, key, target, tried)
        error = resumed.error
        if error is None:
            assert resumed.upstream is not None
            return resumed.upstream
        try:
            if isinstance(error, UpstreamError) and retry.resend_on_new_connection(reused=True,
                                                                                   answered=resumed.answered):
                return await self.upstream.resend(target.url, resumed.data, resumed.deadline)
            raise error
        except (TimeoutError, UpstreamError) as exc:
            return self._failed_attempt(exc, key, target, tried)
        except BaseException:
            self._release(target)
            raise

    def _failed_attempt(self, exc: Exception, key: ServiceKey, target: Endpoint,
                        tried: set[Endpoint]) -> RouterError:
        """An attempt that failed before the response began (retry.py, rule 2): the pod's count given back, the pod
        ejected; the answer if no other is left."""
        failed = retry.failed_attempt(exc, isinstance(exc, ConnectFailed), str(key), target.pod,
                                      self.config.first_byte_timeout, len(tried) + 1)
        self._release(target)
        if failed.timed_out:
            self.metrics.timeouts.labels(*key, Phase.FIRST_BYTE).inc()
        tried.add(target)
        self.metrics.retries.labels(*key).inc()
        self._eject(key, target, failed.reason)
        return failed.error or errors.upstream_unreachable(str(key), len(tried))

    def _fields(self, request: Incoming, key: ServiceKey) -> list[bytes]:
        """The client's headers less its credentials; the key back only to a keyed service (the
        request got here past auth.check, so it holds one of that service's keys)."""
        keyed = self.table.api_keys(key) is not None
        return upstream_fields(request.raw_headers, authorization(request) if keyed else None)

    def _eject(self, key: ServiceKey, target: Endpoint, reason: str) -> None:
        now = clock.monotonic()
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

    # the router's own endpoints --------------------------------------------------

    async def _models(self, request: Incoming) -> web.Response:
        # What this client may send as `model`: every addressable name, but a protected
        # InferenceService only to a caller with one of its keys.
        key = authorization(request)
        data = [{"id": name, "object": "model", "created": s.created, "owned_by": "kaon"}
                for name, s in self.table.addressable() if auth.may_list(self.table, s.key, key)]
        if self.routes is not None:  # InferenceRoutes: each a `model` too
            data += self.routes.listed(key)
        return web.json_response({"object": "list", "data": data})

    async def _unknown(self, request: Incoming) -> web.Response:
        """Any other method and path: OpenAI's 404, unread (the body is no one's)."""
        self.metrics.count(None, 404)
        response = errors.unknown_url(request.method, request.path, CLIENT_ROUTES).response()
        response.force_close()
        return response

    async def _health(self, request: Incoming) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _ready(self, request: Incoming) -> web.Response:
        return web.json_response({"status": "ok" if self.table.synced else "starting"},
                                 status=200 if self.table.synced else 503)

    async def _metrics(self, request: Incoming) -> web.Response:
        """On the router's own port: the series of open InferenceServices and InferenceRoutes only
        (anyone may scrape it); every series is on --admin-port (admin_app)."""
        return metrics_response(self.metrics.render(self._open, self._open_route))

    def _open(self, key: ServiceKey) -> bool:
        return self.table.service(key) is not None and self.table.api_keys(key) is None

    def _open_route(self, namespace: str, name: str) -> bool:
        """A route without keys that still exists (a keyed one's series name its tenant's route)."""
        if self.routes is None:
            return False
        route = self.routes.routes.resolve(f"{namespace}/{name}")
        return route is not None and route.key_digests is None

    def admin_app(self) -> web.Application:
        """The port only the scraper and the kubelet reach (main.py: --admin-port): the whole of
        /metrics, and /health and /ready, which answer there even while the main port is at
        --max-connections."""
        app = web.Application()

        async def everything(request: Incoming) -> web.Response:
            return metrics_response(self.metrics.render())
        async def pressure(request: Incoming) -> web.Response:
            return web.json_response(pressure_report.report(self.table, self.inflight, self.held()))
        app.router.add_get("/metrics", everything)
        app.router.add_get("/pressure", pressure)  # the operator's pressure loop (router/pressure.py)
        app.router.add_get("/health", self._health)
        app.router.add_get("/ready", self._ready)
        return app


def _asleep(upstream: Response) -> bool:
    """The engine's refusal while asleep: a 503 marked by ASLEEP_HEADER (kaon_runtime's server/sleep.py)."""
    if upstream.status != 503 or upstream.header(ASLEEP_HEADER.lower().encode()) is None:
        return False
    upstream.release()
    return True


def _engine_path(request: Incoming) -> str:
    """The route as listed (CLIENT_ROUTES), not as the client spelled it (percent-escapes, `..`):
    the engine routes exactly what the router matched."""
    if isinstance(request, FrontRequest):
        assert request.canonical is not None  # only the routes of CLIENT_ROUTES forward
        return request.canonical + ("?" + request.query if request.query else "")
    resource = request.match_info.route.resource
    assert resource is not None  # only the routes of CLIENT_ROUTES forward
    query = request.rel_url.raw_query_string
    return resource.canonical + ("?" + query if query else "")


def _route_path(request: Incoming) -> str:
    if isinstance(request, FrontRequest):
        return request.canonical or request.path
    resource = request.match_info.route.resource
    return resource.canonical if resource is not None else request.path


def metrics_response(body: bytes) -> web.Response:
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})
