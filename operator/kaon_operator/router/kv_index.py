"""Which pod holds which prompt prefix, in which tier: the kv-aware strategy's index, built from
the KV events every engine pod publishes (vLLM's format: engine/kv_events.py in the runtime).

Pure bookkeeping, no I/O (router/kv_feed.py feeds it). An engine names blocks by its own chain
hashes; the index names them by keys of its own, chained over the blocks' token ids
(`block_keys`), so that a request's tokens find them without knowing any engine's hashing, and
every router replica, fed the same events, builds the same index (no shared state to lose).

Only chains the router can follow are indexed: a chain's first block must have no parent block
(parent None), and no LoRA adapter (its blocks were computed with other weights, and an adapter's
id is the engine's own). A block whose hash folds in more than its tokens (vLLM's `extra_keys`: a
cache salt, an adapter's name, an image) is not its tokens' block: the chain is indexed up to it.
A salted request's blocks serve only its own tenant; an image's placeholder tokens are the same for
every image. (kaon's engines before this announced a salted chain's root as its first block's
parent: a parent the router never saw, skipped the same way.)
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

ROOT_KEY = 0
MEDIA = ("GPU", "CPU", "DISK")
"""The engine's pool, host memory, disk: the order a hit is worth (a pool hit costs nothing to
bring back; a disk hit a read)."""
TIER_WEIGHTS = {"GPU": 1.0, "CPU": 0.8, "DISK": 0.5}


def next_key(parent: int, tokens: Sequence[int]) -> int:
    """A block's key after its parent's: 64 bits, the same in every process."""
    data = parent.to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def block_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The keys of a prompt's whole blocks, in order."""
    keys = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = next_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


@dataclass(slots=True)
class _Pod:
    keys: dict[int, int] = field(default_factory=dict)  # engine hash -> index key
    media: dict[int, set[str]] = field(default_factory=dict)  # index key -> media holding it
    last_seq: int = -1
    block_size: int | None = None


@dataclass(frozen=True, slots=True)
class Match:
    blocks: int
    """How many of the prompt's leading blocks the pod holds, in any tier."""
    score: float
    """Those blocks weighted by the tier each is in (TIER_WEIGHTS)."""


class KvIndex:
    def __init__(self):
        self._pods: dict[str, _Pod] = {}

    def pods(self) -> list[str]:
        return list(self._pods)

    def block_size(self, pod: str) -> int | None:
        found = self._pods.get(pod)
        return None if found is None else found.block_size

    def blocks_of(self, pod: str) -> int:
        found = self._pods.get(pod)
        return 0 if found is None else len(found.media)

    # ---- events ----------------------------------------------------------------------

    def sequence(self, pod: str, seq: int) -> int | None:
        """Note a batch's sequence number; a number that went back means the engine restarted
        (a new publisher counts from 0): its entries are dropped. Returns the first sequence
        number missed when there is a gap (the caller asks the pod to replay from there), else None.
        A pod first heard of past its first batch (a router replica started after the engines, ZMQ's
        slow joiner, a restart seen late) is replayed from 0: the blocks it stored before are in no
        later batch, and every replica must build the same index."""
        state = self._pods.setdefault(pod, _Pod())
        if seq <= state.last_seq:
            self.clear(pod)
            state = self._pods.setdefault(pod, _Pod())
        missed = state.last_seq + 1 if seq > state.last_seq + 1 else None
        state.last_seq = seq
        return missed

    def stored(self, pod: str, block_hashes: Sequence[int], parent: int | None, token_ids: Sequence[int],
               block_size: int, lora_id: int | None, medium: str | None,
               extra_keys: Sequence[object] | None = None) -> None:
        """`extra_keys`: one entry a block, what its hash folds in besides its tokens (None: nothing)."""
        state = self._pods.setdefault(pod, _Pod())
        if lora_id:
            return
        if parent is None:
            key = ROOT_KEY
        elif parent in state.keys:
            key = state.keys[parent]
        else:
            return  # a chain the router cannot follow (a salted root, or a parent it never saw)
        state.block_size = block_size
        for i, h in enumerate(block_hashes):
            tokens = token_ids[i * block_size:(i + 1) * block_size]
            if len(tokens) < block_size or (extra_keys and i < len(extra_keys) and extra_keys[i]):
                return
            key = next_key(key, tokens)
            state.keys[h] = key
            state.media.setdefault(key, set()).add(medium or "GPU")

    def removed(self, pod: str, block_hashes: Iterable[int], medium: str | None) -> None:
        state = self._pods.get(pod)
        if state is None:
            return
        for h in block_hashes:
            key = state.keys.get(h)
            if key is None:
                continue
            media = state.media.get(key, set())
            media.discard(medium or "GPU")
            if not media:
                state.media.pop(key, None)
                del state.keys[h]

    def clear(self, pod: str) -> None:
        """Forget the pod (a restart, the pod gone): its entries and its sequence number."""
        self._pods.pop(pod, None)

    def cleared(self, pod: str) -> None:
        """The pod's engine holds nothing (AllBlocksCleared): its entries go, its sequence number stays. Every
        engine's batch 0 says it; forgetting the number too made each later batch look like a pod heard of
        mid-life, answered by a replay of the engine's whole buffer, batch after batch."""
        state = self._pods.get(pod)
        if state is not None:
            self._pods[pod] = _Pod(last_seq=state.last_seq)

    def keep_only(self, pods: Iterable[str]) -> None:
        """Drop the pods no longer ready."""
        for pod in set(self._pods) - set(pods):
            del self._pods[pod]

    # ---- lookups ---------------------------------------------------------------------

    def match(self, pod: str, keys: Sequence[int]) -> Match:
        """How much of a prompt's leading blocks (`block_keys`) the pod holds."""
        state = self._pods.get(pod)
        blocks, score = 0, 0.0
        if state is not None:
            for key in keys:
                media = state.media.get(key)
                if not media:
                    break
                blocks += 1
                score += max(TIER_WEIGHTS.get(m, 0.5) for m in media)
        return Match(blocks, score)
