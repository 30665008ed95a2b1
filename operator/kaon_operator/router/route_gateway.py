"""The router's side of InferenceRoute: the one object the proxy calls for a `model` that names a route.

`match()` tells whether `model` names a route (an InferenceService of the same name wins). `plan()`
checks the route's keys, classifies the request (classifier.py, then the monitor's escalations),
looks it up in the cache (exact, then semantic) and either returns the cached Answer (replayed by
`replay()`) or a Plan: the tier's `model` and body, the headers to add, and a tee that keeps the
response as it is relayed. `finish()` stores a complete answer, counts it, and with
`verify.fraction` re-asks the top tier in the background (monitor.py).

Internal requests (the top tier's second opinion, the embedder's vectors) go through the router's
own choice of pod and its session, with the client's key, so a route reaches nothing its caller
could not reach directly in the route's namespace.

Why one module past 300 lines: RouteGateway is one request's path (classify, cache, forward, verify)
and its decisions already live in routes/ as pure modules; what is left here is the I/O between them.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge

from kaon_operator import clock
from kaon_operator.api import Key
from kaon_operator.router import auth, errors, unawaited
from kaon_operator.router.front import open_stream
from kaon_operator.router.metrics import ROUTE_LABELS
from kaon_operator.router.request import upstream_headers
from kaon_operator.routes import anchors, cache_keys, classifier, learned, monitor
from kaon_operator.routes.answers import Answer, answer_text, stream_whole, usage_tokens
from kaon_operator.routes.figures import Figures
from kaon_operator.routes.memory_store import MemoryStore
from kaon_operator.routes.table import Route, RouteTable

logger = logging.getLogger("kaon.routes")

TIER_HEADER = "x-kaon-route-tier"
CACHE_HEADER = "x-kaon-cache"
"""hit or miss on every answer, as the issue names them (a request that may not be cached is a miss too)."""
BYPASS_HEADER = "x-kaon-cache-bypass"
"""Set (to not-cacheable) beside a miss whose answer is not stored: sampled without a seed, and the like."""
EMBED_PATH = "/v1/embeddings"
MAX_VERIFYING = 32


class Store(Protocol):
    max_entries: int

    async def get(self, key: str) -> Answer | None: ...
    async def put(self, key: str, answer: Answer, ttl: float) -> None: ...
    async def nearest(self, scope: str, vector: list[float]) -> tuple[float, str] | None: ...
    async def add_vector(self, scope: str, vector: list[float], key: str, ttl: float) -> None: ...
    async def close(self) -> None: ...


@dataclass
class Plan:
    """A route request on its way to a tier; the relay calls `tee` with each chunk it passes on and
    `done` once the body ended complete."""

    route: Route
    tier: int
    request_class: str
    model: str
    body: bytes
    payload: dict
    path: str
    authorization: str | None
    stream: bool
    cache_key: str | None
    semantic: tuple[str, list[float], str] | None = None
    """(semantic scope, the prompt's embedding, the prompt's text) when the semantic cache is on."""
    escalated_from: int | None = None
    """The tier just below `tier` when the monitor's escalation moved the request up to it: a
    `verify.fraction` of these is also asked of that tier, to see whether the class may return."""
    headers: dict[str, str] = field(default_factory=dict)
    chunks: list[bytes] = field(default_factory=list)
    status: int = 0
    content_type: str = ""
    complete: bool = False
    stored: bool = False
    on_stream_end: Callable[[Plan], Awaitable[None]] | None = None

    @property
    def service(self) -> str:
        return self.route.services[self.tier]

    async def tee(self, data: bytes) -> None:
        self.chunks.append(bytes(data))
        # A stream's last event: store the answer before the client gets it, so that a client asking
        # again as soon as it read [DONE] finds it (a whole body is stored before it is sent at all).
        if self.stream and data.rstrip().endswith(b"data: [DONE]") and self.on_stream_end is not None:
            self.done(200, "text/event-stream")
            await self.on_stream_end(self)

    def done(self, status: int, content_type: str) -> None:
        self.status, self.content_type, self.complete = status, content_type, True


@dataclass
class Hit:
    route: Route
    answer: Answer


class RouteMetrics:
    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter("kaon_route_requests", "Requests to an InferenceRoute, by the tier that answered "
                                "(for a cache hit: the tier that answered first) and cache (hit, miss, none)",
                                [*ROUTE_LABELS, "tier", "cache"], registry=registry)
        self.tokens = Counter("kaon_route_engine_tokens", "Prompt and completion tokens the tiers' engines computed "
                              "for the route (cache hits add none)", [*ROUTE_LABELS, "tier"], registry=registry)
        self.cost = Counter("kaon_route_cost", "The route's engine tokens priced at each tier's "
                            "costPerMillionTokens", ROUTE_LABELS, registry=registry)
        self.top_cost = Counter("kaon_route_top_tier_cost", "What the same requests (cache hits included) would "
                                "have cost on the top tier", ROUTE_LABELS, registry=registry)
        self.verifications = Counter("kaon_route_verifications", "Lower-tier answers re-asked of the top tier, "
                                     "by whether they agreed", [*ROUTE_LABELS, "tier", "class", "agreed"],
                                     registry=registry)
        self.agreement = Gauge("kaon_route_agreement", "Agreement with the top tier over the last comparisons, per "
                               "tier and class", [*ROUTE_LABELS, "tier", "class"], registry=registry)
        self.escalations = Counter("kaon_route_escalations", "Classes escalated to the next tier because their "
                                   "agreement fell below verify.minAgreement", [*ROUTE_LABELS, "tier", "class"],
                                   registry=registry)
        self.recoveries = Counter("kaon_route_escalation_ends", "Escalated classes returned to their tier because "
                                  "their agreement since the escalation reached verify.recoverAgreement",
                                  [*ROUTE_LABELS, "tier", "class"], registry=registry)
        self.monitor_fallbacks = Counter("kaon_route_monitor_fallbacks", "Long answers the quality monitor "
                                         "compared by word overlap because the route's embedder did not answer",
                                         ROUTE_LABELS, registry=registry)
        self.semantic_refused = Counter("kaon_route_semantic_refused", "Semantic cache matches above the "
                                        "threshold refused as near misses by the guard (another number or "
                                        "name, a swap, one word put for another, a constraint added: anchors.py)",
                                        ROUTE_LABELS, registry=registry)
        self.classifier_fallbacks = Counter("kaon_route_classifier_fallbacks", "Requests of a route with the learned "
                                            "classifier that the rule set decided instead, by why (embedder "
                                            "unreachable, dimension mismatch)", [*ROUTE_LABELS, "reason"],
                                            registry=registry)


class RouteGateway:
    def __init__(self, router: Any, routes: RouteTable, rng: random.Random | None = None,
                 store_factory: Callable[[Route], Store] | None = None):
        """`router`: the proxy's Router (its table, pod choice and session)."""
        self.router, self.routes = router, routes
        self.table = router.table
        self.rng = rng or random.Random()
        self.metrics = RouteMetrics(router.metrics.registry)
        self.store_factory = store_factory or _default_store
        self._stores: dict[tuple[Key, str | None], Store] = {}
        self.figures: dict[Key, Figures] = {}
        self.agreement: dict[Key, monitor.Agreement] = {}
        self.on_escalation: list[Callable[[Route, str, str, float, int, bool], None]] = []
        """Called with (route, tier, class, agreement, samples, escalated) when a class is escalated
        (True) or returns to its tier (False)."""
        self._background: set[asyncio.Task] = set()
        # The default namespace's route names are its own: --cluster-wide-names must not hand them to another
        # namespace's InferenceService (which the table's readings try before any route: match()).
        table_changed = routes.on_change

        def changed(key: Key) -> None:
            self.table.reserve(r.key.name for r in routes.routes() if r.key.namespace == routes.default_namespace)
            table_changed(key)
        routes.on_change = changed
        self.table.reserve(r.key.name for r in routes.routes() if r.key.namespace == routes.default_namespace)

    # which requests ------------------------------------------------------------

    def match(self, model: str) -> Route | None:
        if self.table.resolve(model) is not None:
            return None  # an InferenceService of that name is reached as before
        return self.routes.resolve(model)

    def listed(self, authorization: str | None) -> list[dict]:
        """GET /v1/models' entries for the routes this caller may use (a keyed route only to a holder of one
        of its keys), under the name that reaches them; one an InferenceService's name shadows is left out."""
        out = []
        token = auth.bearer(authorization)
        for route in self.routes.routes():
            bare = route.key.namespace == self.routes.default_namespace
            name = route.key.name if bare else f"{route.key.namespace}/{route.key.name}"
            if self.match(name) is not route:
                continue
            if route.key_digests is None or auth.accepted(token, route.key_digests):
                out.append({"id": name, "object": "model", "created": 0, "owned_by": "kaon"})
        return out

    def store(self, route: Route) -> Store:
        where = (route.key, route.spec.cache.valkey)
        found = self._stores.get(where)
        if found is None:
            found = self._stores[where] = self.store_factory(route)
        found.max_entries = route.spec.cache.max_entries
        return found

    # the request ----------------------------------------------------------------

    async def plan(self, route: Route, path: str, payload: dict, authorization: str | None) -> Plan | Hit:
        token = auth.bearer(authorization)
        if route.key_digests is not None and not auth.accepted(token, route.key_digests):
            raise errors.model_not_found(f"{route.key.namespace}/{route.key.name}")
        spec = route.spec
        text = classifier.prompt_text(path, payload)
        vectors: dict[str, list[float] | None] = {}  # embedder -> the prompt's embedding (fetched once)
        tier, request_class = await self._classify(route, text, authorization, vectors)
        agreement = self.agreement.get(route.key)
        classified = tier
        tier = monitor.escalate(tier, request_class, route.services, agreement.escalated if agreement else set())
        stream = payload.get("stream") is True
        generation = self._generation(route)
        scope = cache_keys.scope(route.key.namespace, route.key.name, auth.digest(token) if token else None)
        cache_key, semantic = None, None
        if spec.cache.exact.enabled and cache_keys.cacheable(payload, spec.cache.exact.deterministic_only):
            cache_key = cache_keys.exact_key(scope, generation, path, payload)
            store = self.store(route)
            found = await store.get(cache_key)
            embedder = spec.cache.semantic.embedder
            if found is None and spec.cache.semantic.enabled and embedder:
                if embedder not in vectors:
                    vectors[embedder] = await self._embed(route, embedder, text, authorization)
                vector = vectors[embedder]
                if vector is not None:
                    sem_scope = cache_keys.semantic_scope(scope, generation, path, payload, text)
                    semantic = (sem_scope, vector, text)
                    near = await store.nearest(sem_scope, vector)
                    semantic_spec = spec.cache.semantic
                    if near is not None and near[0] >= min(semantic_spec.threshold, semantic_spec.same_words_threshold):
                        found = await store.get(near[1])
                        # The embedder finds near misses close too (another number, direction, a
                        # word put for its opposite): the guard refuses their shape, and asks a close
                        # embedding of prompts in other words (anchors.verdict, cut_off).
                        if found is not None:
                            verdict = anchors.verdict(text, found.prompt)
                            needed = anchors.cut_off(verdict, semantic_spec.threshold,
                                                     semantic_spec.same_words_threshold)
                            if needed is None or near[0] < needed:
                                if verdict == anchors.REFUSED and near[0] >= semantic_spec.threshold:
                                    self.metrics.semantic_refused.labels(*route.key).inc()  # the guard's doing
                                found = None
            if found is not None:
                return Hit(route, found)
        model = self._tier_model(route, tier)
        payload = {**payload, "model": model}
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8", "surrogatepass")
        headers = {TIER_HEADER: route.services[tier], CACHE_HEADER: "miss"}
        if not cache_key:
            headers[BYPASS_HEADER] = "not-cacheable"
        return Plan(route, tier, request_class, model, body, payload, path, authorization, stream,
                    cache_key, semantic, tier - 1 if tier > classified else None, headers,
                    on_stream_end=self._store)

    async def _classify(self, route: Route, text: str, authorization: str | None,
                        vectors: dict[str, list[float] | None]) -> tuple[int, str]:
        """(tier, class): the learned model on the prompt's embedding when the route has one and its embedder
        answers a vector of the model's size; otherwise the rule set (a learned route's fallback is counted)."""
        spec = route.spec
        chosen = spec.classifier.learned if spec.classifier.mode == "learned" else None
        if chosen is not None:
            vector = vectors[chosen.embedder] = await self._embed(route, chosen.embedder, text, authorization)
            reason = "embedder_unreachable"
            if vector is not None:
                try:
                    found = learned.decide(chosen.model, vector, route.services)
                    return found.tier, found.request_class
                except learned.DimensionMismatch as exc:
                    reason = "dimension_mismatch"
                    logger.warning("route %s: %s; the rule set decides", route.key, exc)
            self.metrics.classifier_fallbacks.labels(*route.key, reason).inc()
        decision = classifier.classify(text, spec.classifier.rules.thresholds, len(spec.tiers))
        return decision.tier, decision.request_class

    def _tier_model(self, route: Route, tier: int) -> str:
        """`<namespace>/<served name>` of the tier's InferenceService, which the table resolves to it."""
        key = Key(route.key.namespace, route.services[tier])
        service = self.table.service(key)
        model = f"{key.namespace}/{service.served_name}" if service is not None else ""
        if service is None or self.table.resolve(model) != key:
            why = "does not exist" if service is None else "does not answer its served name (another serves it)"
            raise errors.RouterError(503, f"InferenceRoute {route.key}: its tier {key.name!r} is no reachable "
                                     f"InferenceService of namespace {key.namespace} (it {why}); the route's "
                                     "Ready condition says so", "service_unavailable", "route_tier_missing",
                                     retry=True)
        return model

    def _generation(self, route: Route) -> str:
        models = []
        for name in route.services:
            service = self.table.service(Key(route.key.namespace, name))
            models.append(getattr(service, "model_digest", "") if service else "")
        return cache_keys.generation(models)

    async def replay(self, request: web.Request, hit: Hit) -> web.StreamResponse:
        """The cached answer as it was sent the first time: a stream event by event, a body whole."""
        answer, route = hit.answer, hit.route
        figures = self.figures.setdefault(route.key, Figures())
        top = route.spec.tiers[-1].cost_per_million_tokens
        figures.hit(answer.tokens, top)
        labels = list(route.key)
        self.metrics.requests.labels(*labels, answer.tier, "hit").inc()
        self.metrics.top_cost.labels(*labels).inc(answer.tokens * top / 1e6)
        headers = {"Content-Type": answer.content_type, TIER_HEADER: answer.tier, CACHE_HEADER: "hit"}
        if len(answer.chunks) <= 1 and not answer.content_type.startswith("text/event-stream"):
            return web.Response(status=answer.status, body=answer.body, headers=headers)
        response = await open_stream(request, answer.status, None, {**headers, "Cache-Control": "no-cache"})
        for chunk in answer.chunks:
            await response.write(chunk)
        await response.write_eof()
        return response

    async def finish(self, plan: Plan) -> None:
        """After the relay: count the answer, store it when it is complete and cacheable, maybe verify it."""
        route, labels = plan.route, list(plan.route.key)
        if not plan.complete:
            return
        tokens = usage_tokens(plan.chunks, plan.stream)
        tier = route.spec.tiers[plan.tier]
        top = route.spec.tiers[-1].cost_per_million_tokens
        self.figures.setdefault(route.key, Figures()).answered(tier.service, tokens, tier.cost_per_million_tokens,
                                                               top)
        cache = "none" if BYPASS_HEADER in plan.headers else plan.headers[CACHE_HEADER]
        self.metrics.requests.labels(*labels, tier.service, cache).inc()
        self.metrics.tokens.labels(*labels, tier.service).inc(tokens)
        self.metrics.cost.labels(*labels).inc(tokens * tier.cost_per_million_tokens / 1e6)
        self.metrics.top_cost.labels(*labels).inc(tokens * top / 1e6)
        if plan.status != 200:
            return
        await self._store(plan)
        # At most MAX_VERIFYING second opinions at once: under load the monitor samples less rather than
        # doubling the top tier's queue.
        if len(self._background) < MAX_VERIFYING and monitor.should_verify(
                self.rng, route.spec.verify.fraction, plan.tier, len(route.spec.tiers)):
            text = answer_text(plan.chunks, plan.stream)
            self._spawn(self._verify(plan, text))
        elif (plan.escalated_from is not None and len(self._background) < MAX_VERIFYING
              and monitor.should_verify(self.rng, route.spec.verify.fraction, plan.escalated_from,
                                        len(route.spec.tiers))):
            self._spawn(self._probe(plan, answer_text(plan.chunks, plan.stream)))

    async def _store(self, plan: Plan) -> None:
        """Keep a complete 200 answer under the plan's key (once)."""
        if plan.stored or plan.cache_key is None or plan.status != 200:
            return
        if plan.stream and not stream_whole(plan.chunks):  # it failed part way: relayed, never replayed
            return
        plan.stored = True
        route = plan.route
        answer = Answer(plan.status, plan.content_type, tuple(plan.chunks), plan.service,
                        usage_tokens(plan.chunks, plan.stream), plan.semantic[2] if plan.semantic else "")
        store = self.store(route)
        ttl = route.spec.cache.ttl_seconds
        await store.put(plan.cache_key, answer, ttl)
        if plan.semantic is not None:
            await store.add_vector(plan.semantic[0], plan.semantic[1], plan.cache_key, ttl)

    # the quality monitor ---------------------------------------------------------

    async def _verify(self, plan: Plan, text: str) -> None:
        route = plan.route
        top = len(route.services) - 1
        payload = {k: v for k, v in plan.payload.items() if k not in ("stream", "stream_options")}
        payload["model"] = self._tier_model(route, top)
        status, body = await self.call(payload["model"], plan.path, payload, plan.authorization)
        if status != 200:
            logger.info("route %s: the top tier's second opinion failed (%d); not counted", route.key, status)
            return
        reference = answer_text([body], False)
        agreed = await self._agree(route, text, reference, plan.authorization)
        self.record(route, plan.service, plan.request_class, agreed)

    async def _probe(self, plan: Plan, text: str) -> None:
        """An escalated class's request, answered one tier up, asked also of the tier it left and compared
        with the top tier's answer (this one when it came from the top tier): may the class return?"""
        route, lower = plan.route, plan.escalated_from
        assert lower is not None
        top = len(route.services) - 1
        payload = {k: v for k, v in plan.payload.items() if k not in ("stream", "stream_options")}
        answers = {}
        for tier in (lower, top) if plan.tier != top else (lower,):
            payload["model"] = self._tier_model(route, tier)
            status, body = await self.call(payload["model"], plan.path, payload, plan.authorization)
            if status != 200:
                logger.info("route %s: the escalation probe of tier %s failed (%d); not counted", route.key,
                            route.services[tier], status)
                return
            answers[tier] = answer_text([body], False)
        reference = answers.get(top, text)
        agreed = await self._agree(route, answers[lower], reference, plan.authorization)
        self.record(route, route.services[lower], plan.request_class, agreed)

    async def _agree(self, route: Route, answer: str, reference: str, authorization: str | None) -> bool:
        """monitor.agree, with the cosine of the two answers' embeddings for long answers when the route
        has an embedder that answers (else word overlap, counted in kaon_route_monitor_fallbacks)."""
        embedder = route.spec.monitor_embedder()
        similarity = None
        if embedder and monitor.is_long(answer, reference):
            vectors = await self._embed_many(route, embedder, [answer, reference], authorization)
            if vectors is not None and len(vectors[0]) == len(vectors[1]):
                similarity = monitor.cosine(vectors[0], vectors[1])
            else:
                self.metrics.monitor_fallbacks.labels(*route.key).inc()
        return monitor.agree(answer, reference, similarity, route.spec.verify.similarity)

    def record(self, route: Route, tier: str, request_class: str, agreed: bool) -> None:
        agreement = self.agreement.setdefault(route.key, monitor.Agreement())
        agreement.record(tier, request_class, agreed)
        labels = list(route.key)
        self.metrics.verifications.labels(*labels, tier, request_class, str(agreed).lower()).inc()
        rate, _ = agreement.rate(tier, request_class)
        self.metrics.agreement.labels(*labels, tier, request_class).set(rate)
        verify = route.spec.verify
        bar = monitor.recovery_bar(verify.min_agreement, verify.recover_agreement)
        for tier_, cls, rate, samples, escalated in agreement.changes(verify.min_agreement, verify.min_samples, bar):
            if escalated:
                self.metrics.escalations.labels(*labels, tier_, cls).inc()
                logger.warning("route %s: class %s on tier %s agrees with the top tier in %.0f%% of %d comparisons "
                               "(below verify.minAgreement %.0f%%): escalated to the next tier", route.key, cls,
                               tier_, rate * 100, samples, verify.min_agreement * 100)
            else:
                self.metrics.recoveries.labels(*labels, tier_, cls).inc()
                logger.warning("route %s: class %s on tier %s agrees with the top tier in %.0f%% of %d comparisons "
                               "since its escalation (at least %.0f%%): back on its tier", route.key, cls, tier_,
                               rate * 100, samples, bar * 100)
            for callback in self.on_escalation:
                callback(route, tier_, cls, rate, samples, escalated)

    # internal requests -----------------------------------------------------------

    async def call(self, model: str, path: str, payload: dict, authorization: str | None) -> tuple[int, bytes]:
        """One request of the router's own to the service `model` names (the same pod choice and key
        checks as a client's); (status, body), 502 when no pod answered."""
        router = self.router
        try:
            key, target, _ = await router._choose(model, set(), clock.monotonic(), path, payload, authorization)
        except errors.RouterError as exc:
            return exc.status, b""
        keyed = self.table.api_keys(key) is not None
        headers = upstream_headers({"Content-Type": "application/json"}, authorization if keyed else None)
        service = self.table.service(key)
        if service is not None:  # the engine answers its served name only, not `<namespace>/<name>`
            payload = {**payload, "model": self.table.engine_model(model, service)}
        router.inflight[target] = router.inflight.get(target, 0) + 1
        try:
            async with asyncio.timeout(router.config.first_byte_timeout + router.config.idle_timeout):
                async with router._session.post(target.url + path, data=json.dumps(payload).encode(),
                                                headers=headers) as response:
                    return response.status, await response.read()
        except (TimeoutError, OSError, Exception) as exc:  # noqa: BLE001 - an internal request's failure is logged
            logger.info("route: internal request to %s failed: %s", key, exc or type(exc).__name__)
            return 502, b""
        finally:
            router._release(target)

    async def _embed(self, route: Route, embedder: str, text: str, authorization: str | None) -> list[float] | None:
        vectors = await self._embed_many(route, embedder, text, authorization)
        return vectors[0] if vectors else None

    async def _embed_many(self, route: Route, embedder: str, texts: str | list[str],
                          authorization: str | None) -> list[list[float]] | None:
        """The embedder's vectors of `texts` (one request; a str is one text), None when it fails."""
        service = self.table.service(Key(route.key.namespace, embedder))
        if service is None:
            return None
        model = f"{route.key.namespace}/{service.served_name}"
        # A prompt or answer longer than the encoder takes (256 tokens for all-MiniLM-L6-v2) is a 400 unless the
        # request asks for the cut (vLLM's field, kaon's encoder server's too): its first tokens say what it is about.
        ask = {"model": model, "input": texts, "truncate_prompt_tokens": -1}
        status, body = await self.call(model, EMBED_PATH, ask, authorization)
        if status != 200:
            return None
        try:
            data = sorted(json.loads(body)["data"], key=lambda row: row.get("index", 0))
            vectors = [[float(x) for x in row["embedding"]] for row in data]
        except (ValueError, KeyError, IndexError, TypeError, AttributeError):
            return None
        return vectors if len(vectors) == (1 if isinstance(texts, str) else len(texts)) else None

    def _spawn(self, coro) -> None:
        unawaited.keep(self._background, asyncio.ensure_future(coro), logger, "route: a background check")

    async def drain(self) -> None:
        """Wait for the background verifications (tests, shutdown)."""
        while self._background:
            await asyncio.gather(*self._background, return_exceptions=True)

    async def close(self) -> None:
        for store in self._stores.values():
            await store.close()


def _default_store(route: Route) -> Store:
    if route.spec.cache.valkey:
        from kaon_operator.router.valkey_store import ValkeyStore  # redis is imported only when a route names one

        return ValkeyStore(route.spec.cache.valkey, f"kaon:route:{route.key.namespace}:{route.key.name}",
                           route.spec.cache.max_entries)
    return MemoryStore(route.spec.cache.max_entries)
