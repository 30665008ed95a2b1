"""What a request may cost the router before it is forwarded: the bytes held over all requests at
once (its body, then what parsing it costs: json_cost.py), the part of them one client may hold,
and whether a request is read at all (a key that opens nothing is refused on its headers). Pure
decisions, no I/O."""
from __future__ import annotations

import functools
import ipaddress

SMALL_BODY = 64 << 10
LARGE_SHARE = 0.75


class BodyBudget:
    """Bytes held at once for requests, over every request. A request reserves its body's size
    before the body is read, then what parsing it will cost (grow), and gives both back when it is
    answered: a thousand stalled uploads cannot hold a thousand bodies, whoever sends them. Bodies
    over SMALL_BODY may fill only LARGE_SHARE of it, so that while large uploads stall, ordinary
    requests still get in; and one source (source_of: an address, an IPv6 /64) may hold at most
    `source_share` of it, so that one client's idle uploads cannot refuse everyone else."""

    def __init__(self, limit: int, source_share: float = 1.0):
        self.limit = limit
        self.per_source = max(1, int(limit * source_share))
        self._large_room = int(limit * LARGE_SHARE)
        self._most = min(self._large_room, self.per_source)
        self.held = 0
        self.by_source: dict[str, int] = {}

    def reserve(self, size: int, source: str = "") -> bool:
        """Take `size` bytes if they fit (a body larger than the whole budget never does)."""
        room = self.limit if size <= SMALL_BODY else self._large_room
        mine = self.by_source.get(source, 0) + size
        if self.held + size > room or mine > self.per_source:
            return False
        self.held += size
        self.by_source[source] = mine
        return True

    def release(self, size: int, source: str = "") -> None:
        self.held -= size
        left = self.by_source.get(source, 0) - size
        if left > 0:
            self.by_source[source] = left
        else:
            self.by_source.pop(source, None)

    def most_one_request(self) -> int:
        """What one request may hold at most, were the budget empty: beyond it, a 413 (reckoned once: asked of every
        request)."""
        return self._most


def body_size(content_length: int | None, max_body_bytes: int) -> int:
    """What a body will hold at most: its announced length, capped where the router stops reading
    (413); a chunked body (no length) may reach that cap."""
    return max_body_bytes if content_length is None or content_length > max_body_bytes else content_length


@functools.lru_cache(maxsize=4096)  # pure; parsing an address per request cost ~2% of the router's CPU
def source_of(remote: str | None) -> str:
    """Whom a connection counts against: its IPv4 address, or its IPv6 /64 (one host holds a
    whole /64 as easily as one address)."""
    try:
        address = ipaddress.ip_address(remote or "")
    except ValueError:
        return remote or ""
    if address.version == 6 and address.ipv4_mapped is None:
        return str(ipaddress.ip_network(f"{address}/64", strict=False))
    return str(address.ipv4_mapped or address) if address.version == 6 else str(address)
