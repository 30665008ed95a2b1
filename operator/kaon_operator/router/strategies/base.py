"""What a routing strategy is given (one attempt of one request) and what it answers."""
from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from kaon_operator.router.endpoints import Endpoint, Service, ServiceKey


class Attempt(NamedTuple):  # made per request: a NamedTuple is made in a fifth of a frozen dataclass's time
    service: Service
    ready: tuple[Endpoint, ...]
    """Every ready pod of the service."""
    usable: Sequence[Endpoint]
    """The pods this attempt may go to (not tried by the request, not ejected); never empty."""
    inflight: Mapping[Endpoint, int]
    """Requests in flight per pod, this router's."""
    path: str
    payload: Mapping
    """The request's body, parsed."""
    now: float
    """clock.monotonic()."""
    rng: random.Random
    """Breaks ties."""


class Choice(NamedTuple):
    target: Endpoint
    first_choice: bool | None = None
    """prefix-affinity: whether the pod it preferred got the request (False: passed over for
    load; the kaon_router_affinity_hits/overrides counters). None: no preference was made."""


class Strategy(Protocol):
    def pick(self, attempt: Attempt) -> Choice: ...

    def forget(self, key: ServiceKey) -> None:
        """The service has no ready pod left: drop what is kept for it."""
