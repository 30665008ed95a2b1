"""Prefix affinity: send a request to the pod that likely holds its prompt prefix in its KV
cache, by consistent hashing with bounded loads. Pure decisions, as in balance.py.

The router has no tokenizer, so the prompt is hashed by characters: chunks of CHUNK_CHARS,
each chunk's hash chained to its parent's, like the engine's block hashes (which chain token
blocks). Two prompts that share their first k chunks share the first k hashes.

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

Replicas sit on the ring at many points each, so a pod joining or leaving moves only the
anchors next to its own points: about 1/N of them.
"""
from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T", bound=Hashable)

CHUNK_CHARS = 256
VIRTUAL_NODES = 160
NEW_PREFIX_SLACK = 1
"""How many more requests in flight than the least loaded pod a request may find at its ring
owner when no pod holds any of its own prefix."""
BOUND_SLACK = 1
"""How many more requests in flight than the least loaded pod the load bound always allows a
request's first choice. With few requests in flight the mean-based bound rounds to one or two:
on 8 pods with 11 in flight, ceil(1.25 x 12 / 8) = 2, so a conversation's pod with 2 in flight
was passed over while others had 1, and its history prefilled again elsewhere (bench/RESULTS.md,
run T: 102 of 320 first choices passed over, new conversations placed for balance among them).
One request more than elsewhere is no hot spot."""
KNOWN_PREFIXES = 1 << 16
"""Chunk hashes the router remembers (about 100 bytes each): a few thousand conversations."""


def _h(data: bytes) -> int:
    # Stable across processes (unlike hash()), so that every router replica agrees.
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain(text: str, salt: str = "", chunk: int = CHUNK_CHARS) -> list[int]:
    """The chained hashes of the text's chunks: one per full chunk, and one for a partial
    tail (so that a short prompt has a key too). `salt` (the InferenceService) keeps services
    apart."""
    hashes, parent = [], _h(salt.encode())
    for start in range(0, len(text), chunk):
        parent = _h(parent.to_bytes(8, "big") + text[start:start + chunk].encode("utf-8", "surrogatepass"))
        hashes.append(parent)
    return hashes


def _canonical(message) -> str:
    return json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_prefix(path: str, payload: Mapping) -> tuple[str, str] | None:
    """(the text whose prefix the engine will cache, the anchor text for the ring), or None
    when the request carries no prompt the router understands (it then goes by least
    connections). Chat: the messages up to and including the last user turn, each as
    canonical JSON on its own line (what follows the last user turn is not in the cache of
    an earlier turn); the anchor stops at the first user turn. Completions: the prompt."""
    if path.endswith("/chat/completions"):
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
        first, last = (users[0], users[-1]) if users else (len(messages) - 1, len(messages) - 1)
        lines = [_canonical(m) for m in messages[:last + 1]]
        return "\n".join(lines), "\n".join(lines[:first + 1])
    if path.endswith("/completions"):
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = ",".join(map(str, prompt))  # token ids: a prefix of ids is a prefix of this text
        if isinstance(prompt, str) and prompt:
            return prompt, prompt
    return None


class Prefix(NamedTuple):
    hashes: list[int]
    """The chained chunk hashes of the prompt."""
    anchor: int
    """Where the request sits on the ring."""
    own_from: int
    """The first chunk that belongs to this request alone (not to the anchor's text)."""


def prefix(path: str, payload: Mapping, salt: str) -> Prefix | None:
    """The request's prefix keys (None: no prompt to go by). A raw completion's anchor is its
    whole prompt, and its chunks from the second on count when known."""
    found = prompt_prefix(path, payload)
    if found is None:
        return None
    text, anchor = found
    hashes = chain(text, salt)
    if not path.endswith("/chat/completions"):
        return Prefix(hashes, hashes[-1], 1)
    anchored = chain(anchor, salt)
    return Prefix(hashes, anchored[-1], len(anchored) - 1)


class Ring(Generic[T]):
    """A consistent-hash ring of pods, VIRTUAL_NODES points each (hashed from `name(pod)`)."""

    def __init__(self, members: Sequence[T], name=str, vnodes: int = VIRTUAL_NODES):
        self.members = tuple(members)
        points = sorted((_h(f"{name(m)}#{i}".encode()), m) for m in self.members for i in range(vnodes))
        self._keys = [p for p, _ in points]
        self._owners = [m for _, m in points]

    def walk(self, key: int) -> list[T]:
        """Every member once, in ring order from the key's point."""
        if not self._keys:
            return []
        start, seen, order = bisect.bisect(self._keys, key), set(), []
        n = len(self._keys)
        for i in range(n):
            m = self._owners[(start + i) % n]
            if m not in seen:
                seen.add(m)
                order.append(m)
                if len(order) == len(self.members):
                    break
        return order


HOME_WINDOW = 300.0
"""Seconds after its last request that a conversation still counts as active at its pod."""


class Homes:
    """The pod each conversation (by its anchor) last went to, for those active in the last
    `window` seconds: how many conversations each pod is home to (kept up to date as they
    come and go, so a request costs O(1) plus the expired entries). Bounded by `capacity`."""

    def __init__(self, window: float = HOME_WINDOW, capacity: int = KNOWN_PREFIXES):
        self.window, self.capacity = window, capacity
        self._last: OrderedDict[int, tuple[Hashable, float]] = OrderedDict()
        self._count: dict = {}

    def _drop(self, anchor: int) -> None:
        pod, _ = self._last.pop(anchor)
        self._count[pod] -= 1
        if not self._count[pod]:
            del self._count[pod]

    def touch(self, anchor: int, pod: Hashable, now: float) -> None:
        if anchor in self._last:
            self._drop(anchor)
        self._last[anchor] = (pod, now)
        self._count[pod] = self._count.get(pod, 0) + 1
        while len(self._last) > self.capacity:
            self._drop(next(iter(self._last)))

    def home(self, anchor: int, now: float) -> Hashable | None:
        """Where the conversation went last, if it is still active."""
        self.counts(now)
        found = self._last.get(anchor)
        return found[0] if found else None

    def counts(self, now: float) -> Mapping:
        while self._last:  # oldest first: drop the conversations that went quiet
            anchor, (_, seen) = next(iter(self._last.items()))
            if now - seen <= self.window:
                break
            self._drop(anchor)
        return self._count


class KnownPrefixes:
    """Which pods this router sent each prefix chunk to lately: a bounded LRU map."""

    def __init__(self, capacity: int = KNOWN_PREFIXES):
        self.capacity = capacity
        self._where: OrderedDict[int, frozenset] = OrderedDict()

    def get(self, h: int) -> frozenset:
        return self._where.get(h, frozenset())

    def record(self, hashes: Sequence[int], target: Hashable) -> None:
        for h in hashes:
            self._where[h] = self._where.pop(h, frozenset()) | {target}
        while len(self._where) > self.capacity:
            self._where.popitem(last=False)

    def __len__(self) -> int:
        return len(self._where)


def least_by(pods: Sequence[T], key: Callable[[T], object], rng: random.Random) -> T:
    """The pod with the smallest key; ties at random, as least-connections breaks them. A fixed
    order (the ring's) would give every tie of a popular prefix to the same pod: its cheap
    cached prefills would all land there and the costly uncached ones on the other pods,
    whose batches then take longest (same in-flight counts, unequal work)."""
    lowest = min(key(m) for m in pods)
    tied = [m for m in pods if key(m) == lowest]
    return tied[0] if len(tied) == 1 else rng.choice(tied)


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
    return least_by(found, lambda m: inflight.get(m, 0), rng) if found else None


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
    target = least_by(ranked, lambda m: (loads[m], homes[m]), rng)
    return target, target == head
