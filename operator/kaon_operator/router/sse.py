"""Framing a relayed body: a server-sent event stream is passed on in whole events.

An engine's stream arrives in chunks that need not end where its events do. The router
writes only whole events, so that when a stream breaks off the error event it adds is never
glued to the first half of an event. Pure: bytes in, bytes out, no network.
"""
from __future__ import annotations

EVENT_ENDS = (b"\n\n", b"\r\n\r\n")
MAX_PENDING = 1 << 16
"""An unfinished event longer than this is passed on in pieces after all, rather than held
without bound."""


def last_event_end(data: bytes) -> int:
    """Where the last whole event in `data` ends (0: none does)."""
    return max(data.rfind(b"\n\n") + 2 if b"\n\n" in data else 0,
               data.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in data else 0)


class EventFramer:
    """Cuts a text/event-stream body into whole events: `feed` each chunk as it arrives and
    write what it returns; at the end of the body, `flush` returns the unfinished rest."""

    def __init__(self, max_pending: int = MAX_PENDING):
        self.max_pending = max_pending
        self.pending = b""
        """The start of an event whose end has not come yet."""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events this chunk completes, with any held before it (b"": none yet)."""
        data = self.pending + chunk if self.pending else chunk
        self.pending = b""
        if data.endswith(EVENT_ENDS):
            return data
        cut = last_event_end(data)
        if len(data) - cut >= self.max_pending:
            return data
        self.pending = data[cut:]
        return data[:cut]

    def flush(self) -> bytes:
        rest, self.pending = self.pending, b""
        return rest


class Unframed:
    """Any other body: each chunk is passed on as it comes."""

    pending = b""

    @staticmethod
    def feed(chunk: bytes) -> bytes:
        return chunk

    @staticmethod
    def flush() -> bytes:
        return b""
