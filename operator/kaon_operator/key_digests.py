"""Publish the digests of each InferenceService's API keys into its status, so the router
needs no access to Secrets: the operator reads the Secret named by spec.auth.apiKeySecret and
writes `status.auth` (the Secret's name and the SHA-256 of each key, never a key); the router
reads them from the InferenceService it already watches.

One loop for the whole operator (no kopf timer: that would give every object a finalizer),
every few seconds from the caches, so a rotated or deleted Secret is published without a
restart and without a watch on Secrets (the operator only gets the ones named). A status is
written only when it changed. A Secret that is missing or holds no key publishes no digest
(the router then refuses every request to that service) and a Warning Event.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
from collections.abc import Mapping

from pydantic import ValidationError

from kaon_operator import api
from kaon_operator.api import Key
from kaon_operator.context import Context
from kaon_operator.status.conditions import EventSpec

PUBLISH_SECONDS = 3.0

logger = logging.getLogger("kaon.key_digests")


def digests(data: Mapping[str, str] | None) -> list[str]:
    """SHA-256 (hex) of the API keys of a Secret's data: every non-empty value (base64 on the
    wire), trimmed of the newline an `echo` leaves; sorted, so the same keys publish the same list."""
    found = set()
    for value in (data or {}).values():
        try:
            key = base64.b64decode(value or "").strip()
        except (binascii.Error, ValueError):
            continue
        if key:
            found.add(hashlib.sha256(key).hexdigest())
    return sorted(found)


def secret_name(spec: Mapping) -> str | None:
    """spec.auth.apiKeySecret; None without spec.auth; "" when spec.auth does not validate (no
    Secret is read: the router refuses every request)."""
    auth = spec.get("auth")
    if auth is None:
        return None
    try:
        return api.AuthSpec.model_validate(auth).api_key_secret
    except ValidationError:
        return ""


def published(secret: str, data: Mapping[str, str] | None) -> dict:
    """The status.auth to write for `secret` holding `data` (None: missing)."""
    return {"apiKeySecret": secret, "keyDigests": digests(data)}


def missing_event(secret: str, data: Mapping[str, str] | None) -> EventSpec:
    why = "is missing or not Opaque" if data is None else "holds no key"
    return EventSpec("Warning", "NoApiKeys", f"Secret {secret!r} (spec.auth.apiKeySecret) {why}: "
                     "the router refuses every request to this InferenceService")


def publish(ctx: Context, key: Key, body: Mapping) -> None:
    """Write `body`'s status.auth when it differs from what was last written (or read); the
    service's record keeps which."""
    namespace, name = key
    record = ctx.records.get(key)
    secret = secret_name(body.get("spec") or {})
    current = record.auth if record.auth_known else (body.get("status") or {}).get("auth")
    data: dict[str, str] | None
    if secret is None:
        new = None
        data = {}
    else:
        data = ctx.kube.secret_data(namespace, secret) if secret else None
        new = published(secret, data)
    if new == current:
        record.auth, record.auth_known = current, True
        return
    if ctx.kube.patch_status(namespace, name, {"auth": new}) is not None:
        record.auth, record.auth_known = new, True
        logger.info(f"{namespace}/{name}: published {len(new['keyDigests']) if new else 0} API key digests")
        if new is not None and not new["keyDigests"]:
            ctx.post(body, [missing_event(secret or "", data)])


ROUTE_PLURAL = "inferenceroutes"


def publish_route(ctx: Context, key: Key, body: Mapping, written: dict[Key, dict | None]) -> None:
    """An InferenceRoute's status.auth, as publish() writes an InferenceService's (issue 52: a route's keys are
    its own); `written` remembers what was last written per route, as the services' records do."""
    namespace, name = key
    secret = secret_name(body.get("spec") or {})
    current = written[key] if key in written else (body.get("status") or {}).get("auth")
    data: dict[str, str] | None = {}
    new = None
    if secret is not None:
        data = ctx.kube.secret_data(namespace, secret) if secret else None
        new = published(secret, data)
    if new == current:
        written[key] = current
        return
    if ctx.kube.patch_status(namespace, name, {"auth": new}, plural=ROUTE_PLURAL) is not None:
        written[key] = new
        logger.info(f"InferenceRoute {namespace}/{name}: published {len(new['keyDigests']) if new else 0} API key "
                    "digests")


async def publish_loop(ctx: Context) -> None:
    """Every PUBLISH_SECONDS, publish every InferenceService's and InferenceRoute's key digests (status.auth)."""
    routes_written: dict[Key, dict | None] = {}
    while True:
        for key, body in ctx.caches.all_inference_services():
            try:
                await asyncio.to_thread(publish, ctx, key, body)
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                logger.warning(f"publishing {key[0]}/{key[1]}'s key digests failed: {exc}")
        routes = ctx.caches.all_inference_routes()
        for key in set(routes_written) - {key for key, _ in routes}:
            del routes_written[key]  # deleted routes
        for key, body in routes:
            try:
                await asyncio.to_thread(publish_route, ctx, key, body, routes_written)
            except Exception as exc:  # noqa: BLE001 - the next round tries again
                logger.warning(f"publishing InferenceRoute {key[0]}/{key[1]}'s key digests failed: {exc}")
        await asyncio.sleep(PUBLISH_SECONDS)
