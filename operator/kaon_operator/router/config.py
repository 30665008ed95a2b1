"""The router's settings (the kaon-router flags, main.py)."""
from __future__ import annotations

from dataclasses import dataclass


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
