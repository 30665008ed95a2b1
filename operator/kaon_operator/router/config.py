"""The router's settings (the kaon-router flags, main.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kaon_operator.router.json_cost import Limits


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
    write_timeout: float = 30.0
    """Seconds one write of a response may wait for the client to take it (its socket buffer is
    full: it stopped reading); then its connection is dropped and the engine's request cancelled,
    which frees the engine's sequence and the bytes the router held for it."""
    max_attempts: int = 3
    """Pods one request tries when attempts fail before a response began."""
    max_body_bytes: int = 4 << 20  # the engine's own default limit
    header_timeout: float = 10.0
    """Seconds a connection may go without a whole request head: a new one, or an idle keep-alive
    one between requests (then it is closed). A client that trickles its headers holds nothing longer."""
    body_timeout: float = 30.0
    """Seconds to receive a request's whole body once its head is in; then a 408."""
    max_connections: int = 4096
    """Client connections open at once; more get a 503 (with Retry-After) and are closed at once."""
    max_buffered_bytes: int = 128 << 20
    """Request body bytes the router holds at once, over all requests (each counted at its
    Content-Length, or --max-body-bytes when it has none, before it is read; then what parsing it
    costs, json_cost.estimate); a request past it gets a 503 with Retry-After (unread, when its
    Content-Length says so). Keep it well under the pod's memory limit."""
    max_client_share: float = 0.25
    """The part of --max-buffered-bytes one client (an address, an IPv6 /64) may hold at once; past
    it, its own requests get the 503, not everyone's."""
    json_limits: Limits = field(default_factory=Limits)
    """Nesting depth and counts of a request body's JSON, checked before it is parsed (400/413)."""
