"""kv-aware: send a request to the pod whose KV cache holds the longest prefix of its prompt, as
the engines themselves announce it (KV events: kv_feed.py, kv_index.py), within a load bound.

Where prefix-affinity guesses from what this router sent (and cannot see an eviction, another
replica's requests, or a restart), kv-aware reads what each pod holds, in which tier: a block in
the pool counts fully, one in host memory or on disk a little less (it must be copied back).

The choice (`choose`, pure): of the pods within the load bound (prefix-affinity's `capacity`:
ceil(loadBound x mean), or the least loaded pod's count + BOUND_SLACK + 1; and below the
engine's sequence slots when another pod has a free one), the one holding the most of the
prompt's leading blocks *that no other pod within the bound holds* (weighted by tier), ties by
fewest requests in flight. Blocks that two or more of them hold say nothing about where the
request belongs: a system prompt every new conversation shares is the only match a new
conversation has, and ranked by it, every new conversation went to the few pods holding it
(bench run KV8c: 3 of 8 pods got no request; balance max/mean 3.38 vs prefix-affinity's 1.46).
A returning conversation's own turns are at one pod, past the shared part: it still goes there.
When no pod within the bound holds a distinguishing block (a new conversation, a prompt
several pods hold), the least loaded of them gets it, ties by the fewest conversations lately
(prefix-affinity's `Homes`, which kv-aware keeps up to date too), then at random: a conversation's first
turn saves only the shared part wherever it goes, and its later turns follow its own blocks.
All pods over the bound: the least loaded pod. A request the router cannot tokenize yet (the
service's tokenizer is still being fetched) or that holds no prefix anywhere goes by
prefix-affinity, which spreads new conversations and keeps their turns together.
"""
from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from kaon_operator.router.endpoints import Endpoint, ServiceKey
from kaon_operator.router.kv_feed import KvFeed
from kaon_operator.router.kv_index import KvIndex, Match, block_keys
from kaon_operator.router.strategies import least_connections
from kaon_operator.router.strategies.base import Attempt, Choice
from kaon_operator.router.strategies.prefix_affinity import BOUND_SLACK, PrefixAffinity, capacity
from kaon_operator.router.strategies.prefixes import prefix

T = TypeVar("T", bound=Hashable)


def shared_blocks(matches: Mapping[T, Match], pods: Sequence[T]) -> int:
    """How many leading blocks of the prompt at least two of `pods` hold (the second longest
    match): blocks no single pod can claim as where the request belongs."""
    held = sorted((found.blocks for m in pods if (found := matches.get(m)) is not None), reverse=True)
    return held[1] if len(held) > 1 else 0


def distinct_score(found: Match | None, shared: int) -> float:
    """The pod's tier-weighted score for its blocks past the `shared` ones (pro rata: the index
    scores a match as a whole, and a pod's blocks are mostly in one tier)."""
    if found is None or found.blocks <= shared:
        return 0.0
    return found.score * (found.blocks - shared) / found.blocks


def choose(matches: Mapping[T, Match], usable: Sequence[T], inflight: Mapping[T, int], load_bound: float,
           slots: int | None, rng: random.Random, preamble: int = 0,
           homes: Mapping[T, int] | None = None) -> tuple[T, bool]:
    """The pod for a request and whether it holds the longest prefix (False: passed over for
    load, or the prefix is shared and the request went by load). `matches`: what each usable
    pod holds of the prompt; `preamble`: its leading whole blocks every conversation with its
    system prompt shares (never a reason to pick a pod, even where one pod alone holds them);
    `homes`: the conversations active lately per pod (prefix-affinity's `Homes.counts`), which
    break ties between equally loaded pods when no pod holds a distinguishing block."""
    loads = {m: inflight.get(m, 0) for m in usable}
    least = min(loads.values())
    limit = max(capacity(inflight, usable, load_bound), least + BOUND_SLACK + 1)
    if slots is not None:
        limit = min(limit, max(slots, least + 1))

    def score(m: T) -> float:
        found = matches.get(m)
        return found.score if found is not None else 0.0

    best = max(score(m) for m in usable)
    within = [m for m in usable if loads[m] < limit]
    if not within:
        target = least_connections.pick(usable, inflight, rng)
        return target, score(target) == best
    shared = max(shared_blocks(matches, within), preamble)
    distinct = {m: distinct_score(matches.get(m), shared) for m in within}
    top = max(distinct.values())
    # No pod within the bound holds a block the others do not (a conversation's first turn):
    # least connections over all of them, ties by the fewest conversations (between turns a
    # conversation has nothing in flight, and its later turns follow it), then at random;
    # preferring a holder of the shared part on ties is what herded.
    counts = homes if top <= 0 and homes is not None else {}
    target = least_connections.least([m for m in within if distinct[m] == top],
                                     lambda m: (loads[m], counts.get(m, 0)), rng)
    return target, score(target) == best


class KvAware:
    """One per router, for all its services; each pod's events are followed while it is ready."""

    def __init__(self, index: KvIndex | None = None, feed: KvFeed | None = None):
        self.index = index or KvIndex()
        self.feed = feed or KvFeed(self.index)
        self.fallback = PrefixAffinity()
        self._ready: dict[ServiceKey, tuple[Endpoint, ...]] = {}  # each service's ready pods, as last seen

    def pick(self, attempt: Attempt) -> Choice:
        self.feed.follow(self._all_ready(attempt))
        tokenizer = self.feed.tokenizer(attempt.service.key, attempt.ready)
        ids = tokenizer.prompt_ids(attempt.path, attempt.payload) if tokenizer is not None else None
        block_size = next((b for b in (self.index.block_size(e.pod) for e in attempt.ready) if b), None)
        if tokenizer is None or ids is None or block_size is None:
            return self.fallback.pick(attempt)
        keys = block_keys(ids[:-1], block_size)  # the engine always computes the last token itself
        matches = {e: self.index.match(e.pod, keys) for e in attempt.usable}
        if not any(m.blocks for m in matches.values()):
            return self.fallback.pick(attempt)
        preamble = tokenizer.preamble_length(attempt.path, attempt.payload, ids) // block_size
        homes = self.fallback.homes
        target, hit = choose(matches, attempt.usable, attempt.inflight, attempt.service.load_bound,
                             attempt.service.max_num_seqs, attempt.rng, preamble, homes.counts(attempt.now))
        # prefix-affinity's records follow kv-aware's choices, for a later request the index knows nothing of.
        found = prefix(attempt.path, attempt.payload, str(attempt.service.key))
        if found is not None:
            self.fallback.known.record(found.hashes, target)
            homes.touch(found.anchor, target, attempt.now)
        return Choice(target, hit)

    def _all_ready(self, attempt: Attempt) -> list[Endpoint]:
        self._ready[attempt.service.key] = attempt.ready
        return [e for ready in self._ready.values() for e in ready]

    def forget(self, key: ServiceKey) -> None:
        """The service has no ready pod left: its tokenizer and its pods' entries go."""
        self.fallback.forget(key)
        self.feed.forget(key)
        self._ready.pop(key, None)
        still = {e.pod for ready in self._ready.values() for e in ready}
        self.index.keep_only(still)
