"""What a request may cost the router before it is forwarded: the body bytes held over all
requests at once, and whether a request is read at all (a key that opens nothing is refused
on its headers). Pure decisions, no I/O."""
from __future__ import annotations

SMALL_BODY = 64 << 10
LARGE_SHARE = 0.75


class BodyBudget:
    """Request body bytes held at once, over every request. A request reserves its size before its
    body is read and gives it back when it is answered: a thousand stalled uploads cannot hold a
    thousand bodies, whoever sends them. Bodies over SMALL_BODY may fill only LARGE_SHARE of it,
    so that while large uploads stall, ordinary requests still get in."""

    def __init__(self, limit: int):
        self.limit = limit
        self.held = 0

    def reserve(self, size: int) -> bool:
        """Take `size` bytes if they fit (a body larger than the whole budget never does)."""
        room = self.limit if size <= SMALL_BODY else int(self.limit * LARGE_SHARE)
        if self.held + size > room:
            return False
        self.held += size
        return True

    def release(self, size: int) -> None:
        self.held -= size


def body_size(content_length: int | None, max_body_bytes: int) -> int:
    """What a body will hold at most: its announced length, capped where the router stops reading
    (413); a chunked body (no length) may reach that cap."""
    return max_body_bytes if content_length is None else min(content_length, max_body_bytes)
