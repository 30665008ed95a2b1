"""prefix-affinity: send a request to the pod that likely holds its prompt prefix in its KV
cache, by consistent hashing with bounded loads. The decisions are pure functions; the
PrefixAffinity strategy keeps the records they read (prefixes.py: the prompt's keys; ring.py;
records.py: KnownPrefixes, Homes).

The choice, in order of preference:
1. the pod this router last sent the longest known prefix of the prompt to (a conversation's
   earlier turn: its blocks are cached there; of several, the least loaded), counting only
   chunks past the anchor (below). A system prompt every conversation shares says nothing
   about where a conversation lives: counted, it would herd them all onto the first pod it
   went to. Failing that (a turn whose earlier prompt ended part way into a chunk shares no
   whole chunk of its own with it), the pod its conversation (anchor) last went to;
2. otherwise the ring's owner of the request's anchor: for a chat, the conversation up to its
   first user turn, which every later turn repeats, so that a conversation that started on
   its ring owner finds its pod again without memory (after a router restart, or through
   another router replica);
3. and whichever is preferred, it is passed over when taking the request would unbalance the
   service (`choose`), for the least loaded pod (ties at random, as least-connections breaks
   them), which then holds the prefix too (a hot prefix gets replicated instead of piling
   onto one pod):
   - bounded loads: it carries ceil(loadBound x mean) requests in flight already, and more
     than BOUND_SLACK above the least loaded pod (at light loads ceil(loadBound x mean) is
     one or two requests, and the bound alone would move a conversation off its cache for
     one request more there than elsewhere);
   - slots: it has no free sequence slot (engine.maxNumSeqs) and another pod has one, or no
     pod has one and another has fewer requests in flight. The request would wait there for
     running sequences to finish, which costs more than the prefill the cache saves;
   - a popular prefix (several pods hold the longest known prefix: a prompt many clients
     send, where a conversation's latest prefix is at one pod): another pod carries fewer
     requests in flight. Kept on its holders, a burst of it would give them its cheap cached
     prefills and leave the burst's full prefills to the other pods (`choose`);
   - a new prefix (no pod holds any of the request's own chunks: a conversation's first turn)
     saves nothing where it goes, so its ring owner gets it only while it is within
     NEW_PREFIX_SLACK of the least loaded pod, both in requests in flight and in
     conversations active lately (`Homes`). Where a conversation starts is where its later
     turns go, and between turns it has nothing in flight: counting requests alone would
     spread the requests of the moment, not the conversations.
"""
from __future__ import annotations

import math
import random
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.strategies import least_connections
from kaon_operator.router.strategies.base import Attempt, Choice
from kaon_operator.router.strategies.prefixes import prefix
from kaon_operator.router.strategies.records import Homes, KnownPrefixes
from kaon_operator.router.strategies.ring import Rings

T = TypeVar("T", bound=Hashable)

NEW_PREFIX_SLACK = 1
"""How many more requests in flight than the least loaded pod a request may find at its ring
owner when no pod holds any of its own prefix."""
BOUND_SLACK = 1
"""How many more requests in flight than the least loaded pod the load bound always allows a
request's first choice. With few requests in flight the mean-based bound rounds to one or two:
on 8 pods with 11 in flight, ceil(1.25 x 12 / 8) = 2, so a conversation's pod with 2 in flight
would be passed over while others had 1, and its history prefilled again elsewhere. One
request more than elsewhere is no hot spot."""


def holders(hashes: Sequence[int], known: KnownPrefixes, order: Sequence[T]) -> list[T]:
    """The usable pods (`order`: ring order) this router sent the longest known prefix to."""
    for h in reversed(hashes):
        found = [m for m in order if m in known.get(h)]
        if found:
            return found
    return []


def preferred(hashes: Sequence[int], known: KnownPrefixes, order: Sequence[T], inflight: Mapping[T, int], *,
              rng: random.Random) -> T | None:
    """Of the usable pods that hold the longest known prefix, the least loaded (ties at
    random). A prompt that went to several pods (a popular one, passed over for load before)
    is spread over those that cache it, not piled onto one."""
    found = holders(hashes, known, order)
    return least_connections.pick(found, inflight, rng) if found else None


def capacity(inflight: Mapping[T, int], members: Sequence[T], load_bound: float) -> int:
    """Requests in flight a pod may have and still take one more: ceil(bound x mean), the
    mean counting this request (so that an idle service never refuses its first choice)."""
    total = sum(inflight.get(m, 0) for m in members) + 1
    return max(1, math.ceil(load_bound * total / len(members)))


def choose(order: Sequence[T], usable: Sequence[T], inflight: Mapping[T, int], load_bound: float,
           first: T | None = None, slots: int | None = None, homes: Mapping[T, int] | None = None, *,
           rng: random.Random, popular: bool = False) -> tuple[T, bool]:
    """The pod for a request, and whether it is the first choice (False: passed over for load).

    `order`: the pods in ring order from the request's anchor; `first`: the holder of the
    longest known prefix (None: no pod holds any of the request's own chunks: a new prefix);
    `usable`: the pods this attempt may use; `slots`: the engine's maxNumSeqs (None: unknown);
    `homes`: the conversations active lately per pod (`Homes.counts`); `rng` breaks ties;
    `popular`: several pods hold the request's longest known prefix (`holders`).
    The first choice (`first`, else the ring's first usable pod) is kept while it carries
    fewer requests in flight than
    - `capacity` (ceil(load_bound x mean)), or the least loaded pod's count + BOUND_SLACK + 1
      where that is more,
    - `slots`, or when no usable pod has a free slot, the least loaded pod's count + 1 (a
      cached prefix is never bought with a longer wait for a slot),
    - for a new prefix, the least loaded pod's count + NEW_PREFIX_SLACK + 1, and while it is
      home to no more than NEW_PREFIX_SLACK conversations above the pod with the fewest;
    - for a popular prefix, the least loaded pod's count + 1: it goes where least-connections
      would send it, a holder first on ties. A conversation's latest prefix is at one pod
      (where its last turn went); several hold a prompt many clients send. Kept at its
      holders while others carry fewer requests, a burst of it fills them with cheap cached
      prefills and leaves the burst's full prefills to the other pods: the same requests in
      flight everywhere, unequal work, and the slowest batches where the full ones gathered.
      Sent to the least loaded pod, it costs one more copy there, once;
    otherwise the least loaded usable pod gets the request (ties: for a new prefix the fewest
    conversations, then at random)."""
    allowed = set(usable)
    ranked = [first] if first is not None and first in allowed else []
    ranked += [m for m in order if m in allowed and m != first]
    ranked += [m for m in usable if m not in ranked]  # not on the ring (cannot happen, but never drop a pod)
    loads = {m: inflight.get(m, 0) for m in ranked}
    least = min(loads.values())
    limit = max(capacity(inflight, usable, load_bound), least + BOUND_SLACK + 1)
    if slots is not None:
        limit = min(limit, max(slots, least + 1))
    if popular:
        limit = min(limit, least + 1)
    head = ranked[0]
    new = first is None or first not in allowed
    homes = {m: (homes or {}).get(m, 0) for m in ranked} if new else dict.fromkeys(ranked, 0)
    if new:
        limit = min(limit, least + NEW_PREFIX_SLACK + 1)
        settled = homes[head] <= min(homes.values()) + NEW_PREFIX_SLACK
    else:
        settled = True
    if loads[head] < limit and settled:
        return head, True
    target = least_connections.least(ranked, lambda m: (loads[m], homes[m]), rng)
    return target, target == head


class PrefixAffinity:
    """The strategy: one per router, for all its services (prompts are hashed with their
    service as salt, so the records keep services apart); a ring per service."""

    def __init__(self):
        self.known = KnownPrefixes()
        """Where each prompt chunk was sent lately."""
        self.homes = Homes()
        """Which pod each conversation went to, while it is active."""
        self.rings: Rings[ServiceKey, Endpoint] = Rings(name=lambda e: e.pod)

    def pick(self, attempt: Attempt) -> Choice:
        """A request without a prompt to go by goes by least connections."""
        service, usable, inflight, now, rng = (attempt.service, attempt.usable, attempt.inflight, attempt.now,
                                               attempt.rng)
        found = prefix(attempt.path, attempt.payload, str(service.key))
        if found is None:
            return Choice(least_connections.pick(usable, inflight, rng))
        order = [e for e in self.rings.of(service.key, attempt.ready).walk(found.anchor) if e in usable]
        own = found.hashes[found.own_from:]
        first = preferred(own, self.known, order, inflight, rng=rng) or self.homes.home(found.anchor, now)
        target, hit = choose(order, usable, inflight, service.load_bound, first, service.max_num_seqs,
                             self.homes.counts(now), rng=rng, popular=len(holders(own, self.known, order)) > 1)
        self.known.record(found.hashes, target)
        self.homes.touch(found.anchor, target, now)
        return Choice(target, hit)

    def forget(self, key: ServiceKey) -> None:
        self.rings.forget(key)
