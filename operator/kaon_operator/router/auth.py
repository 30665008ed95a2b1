"""API keys at the router: an InferenceService with spec.auth accepts a request only with
`Authorization: Bearer <key>` where the key is one of its Secret's values.

The table keeps SHA-256 digests of the keys, not the keys: the operator publishes them in the
InferenceService's status (key_digests.py), so the router reads no Secret and holds nothing
that works as a key. A request's token is
hashed and compared with every digest in constant time, with no early exit, so neither which
key matched nor how much of one did shows in the time taken.
"""
from __future__ import annotations

import hashlib
import hmac

from kaon_operator.router import errors
from kaon_operator.router.endpoints import EndpointTable, ServiceKey


def digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def bearer(authorization: str | None) -> bytes | None:
    """The token of an `Authorization: Bearer <token>` header, or None."""
    scheme, _, token = (authorization or "").partition(" ")
    token = token.strip()
    return token.encode() if scheme.lower() == "bearer" and token else None


def accepted(token: bytes | None, digests: tuple[bytes, ...]) -> bool:
    presented = digest(token or b"")
    found = False
    for known in digests:  # every one, whatever matched before
        found |= hmac.compare_digest(presented, known)
    return found and token is not None


def check(table: EndpointTable, key: ServiceKey, model: str, authorization: str | None) -> None:
    """Raise the router's refusal unless the request may reach `key`. A protected InferenceService
    answers a caller without one of its keys exactly as a name that does not exist (404): what a
    caller may not use, it cannot tell apart from nothing, so protected names cannot be probed. A
    service whose Secret is missing or holds no key (no digest published) is closed to everyone, the same way."""
    digests = table.api_keys(key)
    if digests is not None and not accepted(bearer(authorization), digests):
        raise errors.model_not_found(model)


def may_send_body(table: EndpointTable, authorization: str | None) -> bool:
    """Whether a request is worth reading, decided on its headers: while every InferenceService
    requires a key, only one whose key opens some service is; otherwise any (a starting router,
    one with no service, or one with an open service answers it after reading it). Which service
    the request names is in the body, read after this."""
    if not table.synced or not table.key_required_everywhere():
        return True
    return accepted(bearer(authorization), table.all_api_keys())


def may_list(table: EndpointTable, key: ServiceKey, authorization: str | None) -> bool:
    """Whether GET /v1/models shows this InferenceService to the caller: open ones to everyone,
    protected ones only to a caller holding one of their keys."""
    digests = table.api_keys(key)
    return digests is None or accepted(bearer(authorization), digests)
