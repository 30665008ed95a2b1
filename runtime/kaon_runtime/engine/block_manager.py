"""KV block allocation with prefix caching.

Blocks are fixed-size pages of the KV pool. A block that fills up with computed tokens
gets a chain hash (parent block's hash + its token ids) and is registered so a later
sequence with the same prefix reuses it instead of recomputing it. A block whose last
owner lets go keeps its contents and stays findable until it is evicted, oldest first.

Every block is in exactly one of three states: owned (ref_count > 0), free and
uncached (`_free`), or free but cached (`_evictable`, in LRU order).

The block manager owns a sequence's `block_table` and `block_hashes` and nothing else of it:
how far a sequence has computed is the scheduler's to change (`Scheduler.update`), so the
calls that place a sequence's blocks return token counts instead of setting them.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Protocol

from kaon_runtime.arith import ceil_div
from kaon_runtime.engine.block_hash import BUILTIN, BlockHasher
from kaon_runtime.engine.sequence import Sequence


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """The builtin chain hash (engine/block_hash.py: the engine's BlockManager uses its configured hasher)."""
    return BUILTIN.chain(parent_hash, token_ids)


def cache_salt_key(salt: str) -> int:
    """A cache salt as root_hash folds it in: the same in every process (KV events announce this, never the salt)."""
    return int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=8).digest(), "big", signed=True)


def root_hash(seq: Sequence, hasher: BlockHasher = BUILTIN) -> int | None:
    """The parent of a sequence's first block: its LoRA adapter and its cache salt folded in
    (BlockHasher.first_parent says why)."""
    salt = seq.params.cache_salt
    return hasher.first_parent(seq.lora_id, None if salt is None else cache_salt_key(salt))


class BlockListener(Protocol):
    """What sees the pool's cached blocks come and go, and holds blocks below it (engine/kv_observer.py:
    KV events and the host/disk tiers). Called on the engine thread; must not block on I/O."""

    def stored(self, blocks: list[Block], seq: Sequence) -> None: ...  # newly cached in the pool
    def evictable(self, block: Block) -> None: ...  # its last owner let go; it stays cached
    def removed(self, block: Block) -> None: ...  # about to leave the pool (its id is reused)
    def holds(self, block_hash: int) -> bool: ...  # a lower tier has it
    def restore(self, block_hash: int, parent: int | None, tokens: tuple[int, ...], block_id: int) -> bool: ...
    def prefetch(self, block_hashes: list[int]) -> None: ...  # a queued sequence's prompt blocks


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hasher: BlockHasher = BUILTIN):
        self.block_size = block_size
        self.hasher = hasher  # --prefix-caching-hash-algo
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[int, int] = {}  # chain hash -> block id
        self.prefix_queries = 0  # tokens of admitted sequences looked up (record_admission)
        self.prefix_hits = 0  # of those, served from the cache
        self.listener: BlockListener | None = None  # KV events and lower tiers (engine/kv_observer.py)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return ceil_div(num_tokens, self.block_size)

    def allocate_prefix(self, seq: Sequence) -> int:
        """Give a sequence without blocks every cached block of its prefix; return the tokens covered
        (the caller records them as computed).

        At least one token is always left to compute: its logits pick the next token.
        """
        assert not seq.block_table, "sequence already holds blocks"
        # A sequence scoring its prompt needs every position's logits, and one mean-pooling it every
        # position's hidden state: they compute them all.
        if self.enable_prefix_caching and seq.params.prompt_logprobs is None and seq.params.pooling != "mean":
            parent = root_hash(seq, self.hasher)
            for i in range((seq.num_tokens - 1) // self.block_size):
                tokens = tuple(seq.token_ids[i * self.block_size:(i + 1) * self.block_size])
                h = self.hasher.chain(parent, tokens)
                block_id = self._cached.get(h)
                if block_id is None:
                    block_id = self._restore(seq, h, parent, tokens)  # from a lower tier, taken
                    if block_id is None:
                        break
                else:
                    block = self.blocks[block_id]
                    if block.token_ids != tokens or block.parent_hash != parent:
                        break  # a hash collision: never serve another prefix's K/V
                    self._take(block_id)
                seq.block_table.append(block_id)
                seq.block_hashes.append(h)
                parent = h
        return len(seq.block_table) * self.block_size

    def _restore(self, seq: Sequence, h: int, parent: int | None, tokens: tuple[int, ...]) -> int | None:
        """A prefix block only a lower tier holds, copied into a free block, cached and taken; None
        without a tier, a free block, or the block (the tier checks its tokens and parent)."""
        if self.listener is None or self.num_free_blocks == 0 or not self.listener.holds(h):
            return None
        block_id = self._pop_free()
        if not self.listener.restore(h, parent, tokens, block_id):
            self.blocks[block_id].ref_count = 0
            self._free.appendleft(block_id)
            return None
        block = self.blocks[block_id]
        block.hash, block.parent_hash, block.token_ids = h, parent, tokens
        self._cached[h] = block_id
        self.listener.stored([block], seq)
        return block_id

    def prefetch(self, seq: Sequence) -> None:
        """Tell the lower tiers a sequence is queued, so they lift its prompt's blocks toward the pool
        while it waits."""
        if self.listener is not None and self.enable_prefix_caching:
            self.listener.prefetch(self.pending_hashes(seq))

    def record_admission(self, seq: Sequence) -> None:
        """Count an admitted sequence's lookup in the hit-rate counters, once per admission.

        Not in allocate_prefix: a sequence that waits for room gives its prefix back and is looked
        up again every step until it fits, and counting each try inflated the hit rate under
        cache pressure, the very case it is read for. A preempted sequence is admitted, and
        counted, again: its recomputation is real work that the cache may save.
        """
        if self.enable_prefix_caching:
            self.prefix_queries += seq.num_tokens
            self.prefix_hits += seq.num_cached_tokens

    def pending_hashes(self, seq: Sequence) -> list[int]:
        """The chain hashes of the sequence's full blocks past those it has computed: what it
        will register as its prefill goes on. Empty without prefix caching."""
        if not self.enable_prefix_caching:
            return []
        return list(self._hashes_after_computed(seq, seq.num_tokens // self.block_size))

    def shared_pending_tokens(self, seq: Sequence, pending: set[int]) -> int:
        """Tokens of a sequence's prompt, just past its cached prefix, that other sequences are
        computing now (`pending`: their `pending_hashes`): blocks that will be in the cache for
        it a step or a few later. Its last token is never counted: it is always computed, as in
        allocate_prefix."""
        shared = 0
        for h in self._hashes_after_computed(seq, (seq.num_tokens - 1) // self.block_size):
            if h not in pending:
                break
            shared += self.block_size
        return shared

    def _hashes_after_computed(self, seq: Sequence, end: int):
        """Chain hashes of the sequence's blocks from the first it has not computed up to `end`."""
        bs = self.block_size
        parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq, self.hasher)
        for i in range(len(seq.block_hashes), end):
            parent = self.hasher.chain(parent, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
            yield parent

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens` tokens; all or nothing."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed > self.num_free_blocks:
            return False
        for _ in range(max(needed, 0)):
            seq.block_table.append(self._pop_free())
        return True

    def truncate(self, seq: Sequence) -> None:
        """Give back the tail blocks beyond the sequence's computed tokens (rejected drafts' slots).

        Such blocks never hold a full run of computed tokens, so they were never registered.
        """
        keep = self.blocks_needed(seq.num_computed_tokens)
        for block_id in seq.block_table[keep:]:
            block = self.blocks[block_id]
            assert block.ref_count == 1 and block.hash is None, f"tail block {block_id} is shared or cached"
            block.ref_count = 0
            self._free.appendleft(block_id)  # first in line: the sequence likely takes it back next step
        del seq.block_table[keep:]

    def commit(self, seq: Sequence) -> None:
        """Register the blocks that have filled up with computed tokens since the last call."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        stored = []
        for i in range(len(seq.block_hashes), seq.num_computed_tokens // bs):
            parent = seq.block_hashes[-1] if seq.block_hashes else root_hash(seq, self.hasher)
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            h = self.hasher.chain(parent, tokens)
            seq.block_hashes.append(h)
            block = self.blocks[seq.block_table[i]]
            # Register a block only if the block before it is the cached one for `parent`.
            # Otherwise that cached block may hold other tokens with the same hash, and a later
            # lookup would pass both checks in allocate_prefix and serve K/V that was computed
            # after different tokens.
            parent_ok = i == 0 or self.blocks[seq.block_table[i - 1]].hash == parent
            if parent_ok and block.hash is None and h not in self._cached:
                block.hash, block.parent_hash, block.token_ids = h, parent, tokens
                self._cached[h] = block.block_id
                stored.append(block)
        if stored and self.listener is not None:
            self.listener.stored(stored, seq)

    def fork(self, parent: Sequence, child: Sequence) -> int:
        """Let `child` share the parent's full computed blocks; it recomputes the partial tail.
        Returns the tokens the shared blocks hold (the caller records them as computed).

        As in allocate_prefix, at least the child's last token is left to compute: its logits
        pick the child's first token.
        """
        assert not child.block_table, "child already holds blocks"
        num_full = min(parent.num_computed_tokens, child.num_tokens - 1) // self.block_size
        for block_id in parent.block_table[:num_full]:
            self._take(block_id)
        child.block_table = parent.block_table[:num_full]
        child.block_hashes = parent.block_hashes[:num_full]
        return num_full * self.block_size

    def free(self, seq: Sequence) -> None:
        """Drop the sequence's blocks (its computed tokens go with them: the caller resets its count).
        Tail blocks go first in eviction order: they are the least shared."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block_id} freed more often than taken"
            if block.ref_count == 0:
                if block.hash is None:
                    self._free.append(block_id)
                else:
                    self._evictable[block_id] = None
                    if self.listener is not None:
                        self.listener.evictable(block)
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._evictable):
            self._uncache(self.blocks[block_id])
            self._free.append(block_id)
        self._evictable.clear()

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        if self._free:
            block_id = self._free.popleft()
        else:
            block_id, _ = self._evictable.popitem(last=False)  # least recently used
            self._uncache(self.blocks[block_id])
        self.blocks[block_id].ref_count = 1
        return block_id

    def _uncache(self, block: Block) -> None:
        assert block.hash is not None, f"block {block.block_id} is not cached"
        if self.listener is not None:
            self.listener.removed(block)
        del self._cached[block.hash]
        block.hash, block.parent_hash, block.token_ids = None, None, ()
