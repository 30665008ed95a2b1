"""The paged KV block manager: allocation, prefix caching, forks and eviction.

A hypothesis state machine drives a BlockManager with random allocations, appends,
forks, frees and aborts over a small pool and a tiny vocabulary (so prefix hits and
evictions really happen), and checks the bookkeeping after every operation. Besides
the manager's own invariants it keeps a shadow KV cache: every computed token writes
"the prefix it was computed under" into its slot, so a sequence that reads a slot holding
another prefix's K/V (a wrong prefix hit, a shared block written to, a block reused
too early) is caught at once. The machine runs twice: with the real chain hash and with
a deliberately weak one whose collisions are frequent.

The tests play the scheduler's part: the block manager places blocks and returns token counts,
and the caller records them as the sequence's computed tokens (it never sets them itself).

Example tests pin down the documented behaviour: hits and their counters, the last token
always left to compute (after a full-prompt hit and after a fork), LRU eviction, and hash
collisions never served as hits, not even through a colliding earlier block.
"""
from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from kaon_runtime.engine import block_manager as bm_module
from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.sampling import SamplingParams

PARAMS = SamplingParams()
TOKEN = st.integers(0, 3)
TOKENS = st.lists(TOKEN, min_size=1, max_size=12)
SEQ_INDEX = st.integers(min_value=0, max_value=1_000)  # taken modulo the number of live sequences
CHUNK = st.integers(1, 12)

_seq_ids = itertools.count()


def make_seq(tokens) -> Sequence:
    tokens = list(tokens)
    return Sequence(next(_seq_ids), tokens, len(tokens), PARAMS)


def run_full(bm: BlockManager, seq: Sequence) -> None:
    """Allocate a new sequence and compute all its tokens, as one prefill would."""
    seq.num_computed_tokens = seq.num_cached_tokens = bm.allocate_prefix(seq)
    assert bm.ensure_slots(seq, seq.num_tokens)
    bm.record_admission(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)


def weak_hash(parent: int | None, token_ids: tuple[int, ...]) -> int:
    """A chain hash blind to each block's first token: blocks [0, 1] and [3, 1] collide."""
    return hash((parent, token_ids[1:]))


# ---- the state machine ---------------------------------------------------------------

class BlockManagerMachine(RuleBasedStateMachine):
    vocab = 4  # tokens are folded onto range(vocab)

    @initialize(num_blocks=st.integers(4, 16), block_size=st.sampled_from([2, 4]))
    def setup(self, num_blocks, block_size):
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.live: list[Sequence] = []
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, slot) -> prefix it holds

    # -- helpers --

    def new_seq(self, tokens) -> Sequence:
        return make_seq(t % self.vocab for t in tokens)

    def pick(self, index: int) -> Sequence:
        return self.live[index % len(self.live)]

    def compute(self, seq: Sequence, num_new: int) -> None:
        """What the model runner does: write K/V for the next tokens, then commit."""
        for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
            block = self.bm.blocks[seq.block_table[pos // self.bs]]
            assert block.ref_count == 1, "writing into a block another sequence shares"
            assert block.hash is None, "writing into a block registered in the prefix cache"
            self.kv[block.block_id, pos % self.bs] = tuple(seq.token_ids[:pos + 1])
        seq.num_computed_tokens += num_new
        self.bm.commit(seq)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """ensure_slots, checking that a failure changes nothing."""
        before = list(seq.block_table), self.bm.num_free_blocks
        if self.bm.ensure_slots(seq, num_tokens):
            assert len(seq.block_table) >= self.bm.blocks_needed(num_tokens)
            return True
        assert (seq.block_table, self.bm.num_free_blocks) == before, "a failed ensure_slots changed state"
        return False

    def admit(self, seq: Sequence, chunk: int) -> None:
        """allocate_prefix, room for the whole prompt, then its first prefill chunk."""
        queries, hits = self.bm.prefix_queries, self.bm.prefix_hits
        cached = self.bm.allocate_prefix(seq)
        assert seq.num_computed_tokens == 0, "the block manager set the sequence's computed tokens"
        assert cached == len(seq.block_table) * self.bs
        seq.num_computed_tokens = seq.num_cached_tokens = cached
        assert cached < seq.num_tokens, "a prefix hit must leave the last token to compute"
        assert (self.bm.prefix_queries, self.bm.prefix_hits) == (queries, hits), "a lookup alone counts nothing"
        if not self.grow(seq, seq.num_tokens):
            self.drop(seq)
            return
        self.bm.record_admission(seq)
        assert self.bm.prefix_queries - queries == seq.num_tokens
        assert self.bm.prefix_hits - hits == cached
        self.live.append(seq)
        self.compute(seq, min(chunk, seq.num_tokens - seq.num_computed_tokens))

    def drop(self, seq: Sequence) -> None:
        self.bm.free(seq)
        seq.num_computed_tokens = 0  # the blocks' K/V went with them
        if seq in self.live:
            self.live.remove(seq)
        assert seq.block_table == [] and seq.block_hashes == [] and seq.num_computed_tokens == 0

    # -- operations --

    @rule(tokens=TOKENS, chunk=CHUNK)
    def allocate(self, tokens, chunk):
        self.admit(self.new_seq(tokens), chunk)

    @precondition(lambda self: self.live)
    @rule(first=SEQ_INDEX, second=SEQ_INDEX, num_blocks=st.integers(0, 6), tail=st.lists(TOKEN, max_size=4),
          chunk=CHUNK)
    def allocate_spliced(self, first, second, num_blocks, tail, chunk):
        """A prompt made of one live sequence's first blocks and another's rest: partial prefix hits."""
        cut = num_blocks * self.bs
        tokens = self.pick(first).token_ids[:cut] + self.pick(second).token_ids[cut:] + tail
        self.admit(self.new_seq(tokens or [0]), chunk)

    @precondition(lambda self: self.live)
    @rule(index=SEQ_INDEX, position=st.integers(0, 12), token=TOKEN, chunk=CHUNK)
    def allocate_variant(self, index, position, token, chunk):
        """A prompt that differs from a live sequence in one token: hits must stop before it."""
        tokens = list(self.pick(index).token_ids)
        tokens[position % len(tokens)] = token
        self.admit(self.new_seq(tokens), chunk)

    @precondition(lambda self: self.live)
    @rule(index=SEQ_INDEX, token=TOKEN)
    def append(self, index, token):
        """Finish the sequence's prefill if needed, then decode one more token."""
        seq = self.pick(index)
        seq.token_ids.append(token % self.vocab)
        if not self.grow(seq, seq.num_tokens):
            self.drop(seq)  # what preemption does
            return
        self.compute(seq, seq.num_tokens - seq.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(index=SEQ_INDEX)
    def fork(self, index):
        parent = self.pick(index)
        child = make_seq(parent.token_ids)
        child.num_computed_tokens = self.bm.fork(parent, child)
        self.live.append(child)
        shared = len(child.block_table)
        assert child.block_table == parent.block_table[:shared]
        assert child.num_computed_tokens == shared * self.bs <= parent.num_computed_tokens
        assert child.num_computed_tokens < child.num_tokens, "a fork must leave the last token to compute"
        if not self.grow(child, child.num_tokens):
            self.drop(child)
            return
        self.compute(child, child.num_tokens - child.num_computed_tokens)

    @precondition(lambda self: self.live)
    @rule(index=SEQ_INDEX)
    def free(self, index):
        self.drop(self.pick(index))

    @rule(tokens=TOKENS)
    def abort_new(self, tokens):
        """A request aborted after it got its blocks but before anything was computed."""
        seq = self.new_seq(tokens)
        seq.num_computed_tokens = self.bm.allocate_prefix(seq)
        self.grow(seq, seq.num_tokens)
        self.drop(seq)

    @precondition(lambda self: self.live)
    @rule(index=SEQ_INDEX, tokens=TOKENS)
    def abort_running(self, index, tokens):
        """A live sequence aborted after growing for new tokens it never computed."""
        seq = self.pick(index)
        seq.token_ids.extend(t % self.vocab for t in tokens)
        self.grow(seq, seq.num_tokens)
        self.drop(seq)

    @rule()
    def reset_prefix_cache(self):
        self.bm.reset_prefix_cache()
        assert not self.bm._evictable
        assert all(b.hash is None for b in self.bm.blocks if b.ref_count == 0)

    # -- invariants --

    @invariant()
    def block_states_are_consistent(self):
        bm = self.bm
        refs = Counter(b for seq in self.live for b in seq.block_table)
        for seq in self.live:
            assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        owned = set()
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: wrong ref_count"
            if block.ref_count:
                owned.add(block.block_id)
        free, evictable = list(bm._free), list(bm._evictable)
        assert len(set(free)) == len(free)
        states = [owned, set(free), set(evictable)]
        assert sum(map(len, states)) == bm.num_blocks
        assert set().union(*states) == set(range(bm.num_blocks)), "a block in no state or in two"
        assert bm.num_free_blocks + len(owned) == bm.num_blocks
        for block_id in free:
            assert bm.blocks[block_id].hash is None, "an uncached free block still has a hash"
        for block_id in evictable:
            assert bm.blocks[block_id].hash is not None, "an evictable block without a hash"

    @invariant()
    def cache_index_is_consistent(self):
        bm = self.bm
        for h, block_id in bm._cached.items():
            assert bm.blocks[block_id].hash == h
        hashed = [b for b in bm.blocks if b.hash is not None]
        assert len(hashed) == len(bm._cached)
        for block in hashed:
            assert len(block.token_ids) == self.bs
            assert self.kv[block.block_id, self.bs - 1][-self.bs:] == block.token_ids, \
                "a cached block's K/V does not hold the tokens it advertises"
        assert 0 <= bm.prefix_hits <= bm.prefix_queries

    @invariant()
    def live_sequences_read_their_own_prefix(self):
        for seq in self.live:
            assert len(seq.block_hashes) == seq.num_computed_tokens // self.bs
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens)
            for i in range(seq.num_computed_tokens // self.bs):
                block = self.bm.blocks[seq.block_table[i]]
                if block.hash is not None:
                    assert block.token_ids == tuple(seq.token_ids[i * self.bs:(i + 1) * self.bs])
            for pos in range(seq.num_computed_tokens):
                slot = seq.block_table[pos // self.bs], pos % self.bs
                assert self.kv.get(slot) == tuple(seq.token_ids[:pos + 1]), \
                    f"seq {seq.seq_id} position {pos} reads another prefix's K/V"

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for seq in list(self.live):
            self.drop(seq)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)


class CollidingHashMachine(BlockManagerMachine):
    """Two tokens only: few distinct blocks, so the weak hash collides all the time."""
    vocab = 2


@pytest.mark.slow
def test_block_manager_state_machine():
    run_state_machine_as_test(BlockManagerMachine, settings=settings(
        max_examples=200, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


@pytest.mark.slow
def test_block_manager_state_machine_with_colliding_hashes(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", weak_hash)
    run_state_machine_as_test(CollidingHashMachine, settings=settings(
        max_examples=500, stateful_step_count=50, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


# ---- examples ------------------------------------------------------------------------

def test_prefix_hit_reuses_blocks_and_counts_hits():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(range(10))
    run_full(bm, first)
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)

    second = make_seq([*range(8), 42, 43])
    second.num_computed_tokens = second.num_cached_tokens = bm.allocate_prefix(second)
    assert second.num_cached_tokens == 8
    bm.record_admission(second)
    assert second.block_table == first.block_table[:2]
    assert second.block_hashes == first.block_hashes[:2]
    assert [bm.blocks[b].ref_count for b in second.block_table] == [2, 2]
    assert (bm.prefix_queries, bm.prefix_hits) == (20, 8)

    other = make_seq([9, *range(1, 10)])  # differs in the first token: nothing shared
    assert bm.allocate_prefix(other) == 0
    assert other.block_table == []


def test_full_prompt_hit_leaves_the_last_block_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq(range(8))
    run_full(bm, first)
    assert len(first.block_hashes) == 2  # both blocks are cached

    again = make_seq(range(8))
    again.num_computed_tokens = bm.allocate_prefix(again)
    assert again.num_computed_tokens == 4
    assert again.block_table == first.block_table[:1]
    assert again.num_tokens - again.num_computed_tokens == 4
    assert bm.ensure_slots(again, again.num_tokens)
    assert again.block_table[1] != first.block_table[1], "the recomputed block must be a fresh one"


def test_freed_cached_blocks_are_evicted_oldest_first_and_only_when_needed():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b, c = make_seq([0, 0]), make_seq([1, 1]), make_seq([2, 2])
    for seq in (a, b, c):
        run_full(bm, seq)
    ids = {name: seq.block_table[0] for name, seq in zip("abc", (a, b, c))}
    for seq in (b, a, c):  # b is freed first: the least recently used
        bm.free(seq)
    assert list(bm._evictable) == [ids["b"], ids["a"], ids["c"]]
    assert bm.num_free_blocks == 4

    def take_one() -> int:
        seq = make_seq([3, 3])
        assert bm.ensure_slots(seq, 2)
        return seq.block_table[0]

    uncached = take_one()
    assert uncached not in ids.values(), "a cached block was evicted while an uncached one was free"
    assert len(bm._cached) == 3
    assert take_one() == ids["b"]
    assert take_one() == ids["a"]
    assert list(bm._evictable) == [ids["c"]]
    assert bm.blocks[ids["b"]].hash is None and bm.blocks[ids["a"]].hash is None

    # The survivor is still served, the evicted ones are not.
    assert bm.allocate_prefix(make_seq([2, 2, 7])) == 2
    assert bm.allocate_prefix(make_seq([0, 0, 7])) == 0


def test_a_hit_moves_a_block_to_the_back_of_the_eviction_order():
    bm = BlockManager(num_blocks=2, block_size=2)
    a, b = make_seq([0, 0]), make_seq([1, 1])
    run_full(bm, a)
    run_full(bm, b)
    a_block, b_block = a.block_table[0], b.block_table[0]
    bm.free(a)
    bm.free(b)
    assert list(bm._evictable) == [a_block, b_block]

    reader = make_seq([0, 0, 5])
    assert bm.allocate_prefix(reader) == 2  # a is used again...
    bm.free(reader)
    assert list(bm._evictable) == [b_block, a_block]  # ...so b is now the oldest

    newcomer = make_seq([3, 3])
    assert bm.ensure_slots(newcomer, 2)
    assert newcomer.block_table == [b_block]
    assert bm.allocate_prefix(make_seq([1, 1, 5])) == 0
    assert bm.allocate_prefix(make_seq([0, 0, 5])) == 2


def test_hash_collision_is_not_served_as_a_hit(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, token_ids: 0)
    bm = BlockManager(num_blocks=8, block_size=2)
    run_full(bm, make_seq([1, 2, 3]))
    assert len(bm._cached) == 1

    stranger = make_seq([3, 4, 5])
    assert bm.allocate_prefix(stranger) == 0
    assert stranger.block_table == [] and bm.prefix_hits == 0

    same = make_seq([1, 2, 9])  # the check does not reject real hits
    assert bm.allocate_prefix(same) == 2


def test_collision_in_an_earlier_block_does_not_serve_a_later_one(monkeypatch):
    """A block computed after a colliding prefix must not be found through the real prefix.

    The weak hash ignores the first token of the first block, so [0, 1] and [9, 1] collide.
    The block [2, 3] computed after [9, 1] holds K/V for context 9 1 2 3: a sequence starting
    0 1 2 3 may reuse the cached [0, 1] block but must compute its own [2, 3].
    """
    def hash_ignoring_first_token(parent, token_ids):
        return hash((parent, token_ids[1:] if parent is None else token_ids))

    monkeypatch.setattr(bm_module, "chain_hash", hash_ignoring_first_token)
    bm = BlockManager(num_blocks=8, block_size=2)
    owner = make_seq([0, 1, 7])
    run_full(bm, owner)
    colliding = make_seq([9, 1, 2, 3, 7])
    run_full(bm, colliding)
    assert colliding.num_cached_tokens == 0  # [9, 1] was not served from [0, 1]

    victim = make_seq([0, 1, 2, 3, 7])
    assert bm.allocate_prefix(victim) == 2
    assert victim.block_table == owner.block_table[:1]
    assert colliding.block_table[1] not in victim.block_table


def test_fork_of_a_block_aligned_prompt_leaves_the_last_token_to_compute():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(8))
    run_full(bm, parent)
    child = make_seq(parent.token_ids)
    child.num_computed_tokens = bm.fork(parent, child)
    assert child.block_table == parent.block_table[:1]
    assert child.num_computed_tokens == 4 < child.num_tokens
    assert bm.blocks[parent.block_table[0]].ref_count == 2
    assert bm.blocks[parent.block_table[1]].ref_count == 1


def test_fork_shares_full_blocks_only():
    bm = BlockManager(num_blocks=8, block_size=4)
    parent = make_seq(range(6))
    run_full(bm, parent)
    child = make_seq(parent.token_ids)
    child.num_computed_tokens = bm.fork(parent, child)
    assert child.block_table == parent.block_table[:1]  # the partial tail is the child's own to fill
    assert child.num_computed_tokens == 4
    assert bm.ensure_slots(child, child.num_tokens)
    assert child.block_table[1] != parent.block_table[1]
    bm.free(parent)
    bm.free(child)
    assert bm.num_free_blocks == bm.num_blocks


def test_ensure_slots_is_all_or_nothing():
    bm = BlockManager(num_blocks=3, block_size=2)
    seq = make_seq(range(5))
    assert bm.ensure_slots(seq, 4)
    assert not bm.ensure_slots(seq, 7)  # needs 4 blocks, only 3 exist
    assert len(seq.block_table) == 2 and bm.num_free_blocks == 1
    assert bm.ensure_slots(seq, 6)
    assert bm.num_free_blocks == 0


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 5], [1, 2, 3, 4]])
def test_prefix_caching_disabled_never_hits(tokens):
    bm = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    run_full(bm, make_seq(tokens))
    again = make_seq(tokens)
    assert bm.allocate_prefix(again) == 0
    assert not bm._cached and again.block_table == []
    assert bm.prefix_queries == 0
