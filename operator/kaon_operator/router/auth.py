"""API keys at the router: an InferenceService with spec.auth accepts a request only with
`Authorization: Bearer <key>` where the key is one of its Secret's values.

The table keeps SHA-256 digests of the keys, not the keys: the router watches every Secret of
the namespaces it serves and keeps nothing in memory that works as a key. A request's token is
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


def check(table: EndpointTable, key: ServiceKey, authorization: str | None) -> None:
    """Raise the router's refusal unless the request may reach `key`: 401 for a missing or wrong
    key; 503 when the InferenceService's Secret is missing or holds no key (closed, never open)."""
    digests = table.api_keys(key)
    if digests is None:
        return
    if not digests:
        service = table.service(key)
        raise errors.no_api_keys(str(key), (service and service.api_key_secret) or "")
    if not accepted(bearer(authorization), digests):
        raise errors.invalid_api_key()


def may_list(table: EndpointTable, key: ServiceKey, authorization: str | None) -> bool:
    """Whether GET /v1/models shows this InferenceService to the caller: open ones to everyone,
    protected ones only to a caller holding one of their keys."""
    digests = table.api_keys(key)
    return digests is None or accepted(bearer(authorization), digests)
