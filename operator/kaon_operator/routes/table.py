"""The InferenceRoutes the router's watch saw, by namespace and name. Fed with objects as dicts (watch
events, whole lists), like the endpoint table; a route whose spec does not validate is left out (and
logged): its name answers 404 rather than reaching a tier it did not mean."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pydantic import ValidationError

from kaon_operator.api import Key
from kaon_operator.routes.api import InferenceRouteSpec

logger = logging.getLogger("kaon.routes")


@dataclass(frozen=True, slots=True)
class Route:
    key: Key
    spec: InferenceRouteSpec
    generation: int
    key_digests: tuple[bytes, ...] | None
    """As an InferenceService's: None without spec.auth, else the digests the operator publishes in
    status.auth for the Secret spec.auth names (empty: closed)."""
    uid: str = ""

    @property
    def services(self) -> list[str]:
        return [t.service for t in self.spec.tiers]


def route(obj: dict) -> Route | None:
    meta = obj.get("metadata") or {}
    key = Key(meta.get("namespace") or "", meta.get("name") or "")
    try:
        spec = InferenceRouteSpec.model_validate(obj.get("spec") or {})
    except ValidationError as exc:
        logger.warning("InferenceRoute %s: spec is not valid, so it routes nothing: %s", key, exc)
        return None
    digests: tuple[bytes, ...] | None = None
    if spec.auth is not None:
        published = (obj.get("status") or {}).get("auth") or {}
        digests = ()
        if isinstance(published, dict) and published.get("apiKeySecret") == spec.auth.api_key_secret:
            digests = tuple(d for d in map(_sha256, published.get("keyDigests") or ()) if d is not None)
    return Route(key, spec, int(meta.get("generation") or 0), digests, str(meta.get("uid") or ""))


def _sha256(hex_digest) -> bytes | None:
    try:
        digest = bytes.fromhex(hex_digest)
    except (TypeError, ValueError):
        return None
    return digest if len(digest) == 32 else None


class RouteTable:
    def __init__(self, default_namespace: str = "default", on_change: Callable[[Key], None] = lambda key: None):
        self.default_namespace = default_namespace
        self.on_change = on_change
        self._routes: dict[Key, Route] = {}

    def resolve(self, model: str) -> Route | None:
        """`<namespace>/<name>`, or a bare name in the default namespace."""
        namespace, slash, name = model.partition("/")
        key = Key(namespace, name) if slash else Key(self.default_namespace, model)
        return self._routes.get(key)

    def routes(self) -> list[Route]:
        return sorted(self._routes.values(), key=lambda r: r.key)

    def apply_route(self, event: str, obj: dict) -> None:
        meta = obj.get("metadata") or {}
        key = Key(meta.get("namespace") or "", meta.get("name") or "")
        found = None if event == "DELETED" else route(obj)
        if found is None:
            self._routes.pop(key, None)
        else:
            self._routes[key] = found
        self.on_change(key)

    def replace_routes(self, namespace: str | None, items: Iterable[dict]) -> None:
        fresh = {r.key: r for r in map(route, items) if r is not None}
        for key in [k for k in self._routes if namespace in (None, k.namespace) and k not in fresh]:
            del self._routes[key]
            self.on_change(key)
        for key, found in fresh.items():
            self._routes[key] = found
            self.on_change(key)
