"""When the router sends a request again, in one place. Pure decisions; proxy.py and upstream.py act on them.

1. A kept-alive engine connection that fails before a single byte of an answer came (the engine closed
   it as the request went out: uvicorn drops idle ones after 5 s) is not the pod's failure: the request
   goes once more to the same pod, on a new connection (upstream.Pool.request).
2. Any other failure before the response began (refused or reset, the engine closing the connection,
   no response head within --first-byte-timeout, a 503 marked asleep) goes to another pod, and the pod
   is ejected (backoff.py), up to --max-attempts pods; the last failure is the answer.
3. Once the response began nothing is sent again (relay.py): the client has part of an answer.
"""
from __future__ import annotations

from typing import NamedTuple

from kaon_operator.router import errors
from kaon_operator.router.errors import RouterError


def resend_on_new_connection(reused: bool, answered: bool) -> bool:
    """Rule 1: whether a failed exchange goes once more to the same pod on a new connection."""
    return reused and not answered


def may_try_another(tried: int, max_attempts: int) -> bool:
    """Rule 2: whether another pod may be tried after `tried` failed (at least one attempt: 0 answers nothing)."""
    return tried < max(1, max_attempts)


class Failed(NamedTuple):
    """An attempt that failed before the response began (rule 2)."""

    reason: str
    """Why the pod is ejected (logged)."""
    error: RouterError | None
    """The answer if no other pod is left to try (None: the generic 502 of every pod tried)."""
    timed_out: bool
    """No response head within --first-byte-timeout (counted as such)."""


def failed_attempt(exc: Exception, connect_failed: bool, service: str, pod: str, first_byte_timeout: float,
                   attempt: int) -> Failed:
    """Rule 2 for the engine client's failures (upstream.py: ConnectFailed when `connect_failed`, TimeoutError,
    UpstreamError)."""
    if connect_failed:
        return Failed(f"cannot connect ({exc})", None, False)
    if isinstance(exc, TimeoutError):
        return Failed(f"no response within {first_byte_timeout:g}s",
                      errors.upstream_timeout(service, pod, "response", first_byte_timeout, attempt), True)
    reason = str(exc) or type(exc).__name__
    return Failed(reason, errors.upstream_failed(service, pod, reason), False)
