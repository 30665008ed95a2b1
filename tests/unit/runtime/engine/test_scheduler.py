"""The continuous-batching scheduler, driven by hand without a model.

A fake runner stands in for the model: it computes the scheduled tokens (writing "the
prefix each token was computed under" into a shadow KV cache, and checking that every
token a sequence attends to holds its own prefix), hands the step to the scheduler's
`update` (which advances the computed counts and commits full blocks), and gives a
sequence a token through `accept` when its computed count reaches its length (the scheduler
ends it at max_tokens: the length stop is its own). The next token is a pure
function of the sequence so far, so every sequence's output is known in advance whatever
the batching, chunking and preemption did to it. Like the engine, it can fork siblings
(n > 1) off a sequence once its prompt is in the cache.
"""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.scheduler import MAX_GATHER_STEPS, ScheduledBatch, Scheduler, gather_prefills
from kaon_runtime.engine.sequence import Sequence, SequenceStatus
from kaon_runtime.sampling import SamplingParams

VOCAB = 4
MAX_STEPS = 2_000

_seq_ids = itertools.count()


def make_seq(tokens, max_tokens: int = 4, n: int = 1) -> Sequence:
    tokens = list(tokens)
    return Sequence(next(_seq_ids), tokens, len(tokens), SamplingParams(max_tokens=max_tokens, n=n))


def next_token(token_ids: list[int]) -> int:
    return (sum(token_ids) * 31 + len(token_ids)) % VOCAB


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt):]


class FakeRunner:
    """Runs scheduled batches the way the engine does, checking the scheduler's contract."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.bm = scheduler.block_manager
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block id, slot) -> prefix it holds
        self.finished: list[Sequence] = []
        self.batches: list[ScheduledBatch] = []

    def slot(self, seq: Sequence, pos: int) -> tuple[int, int]:
        return seq.block_table[pos // self.bm.block_size], pos % self.bm.block_size

    def step(self) -> ScheduledBatch:
        sched = self.scheduler
        running_before = list(sched.running)
        batch = sched.schedule()
        self.batches.append(batch)
        self.check_batch(batch, running_before)
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            for pos in range(seq.num_computed_tokens):  # attention reads the whole context
                assert self.kv.get(self.slot(seq, pos)) == tuple(seq.token_ids[:pos + 1]), \
                    f"seq {seq.seq_id} position {pos} reads another prefix's K/V"
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num_new):
                self.kv[self.slot(seq, pos)] = tuple(seq.token_ids[:pos + 1])
        computed = [seq.num_computed_tokens + num_new for seq, num_new in zip(batch.seqs, batch.num_new_tokens)]
        sched.update(batch)
        assert [seq.num_computed_tokens for seq in batch.seqs] == computed
        for seq in batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:
                if seq.params.n > 1 and seq.index == 0 and seq.num_output_tokens == 0:
                    self.fork_siblings(seq)
                finished = seq.num_output_tokens + 1 == seq.params.max_tokens
                sched.accept(seq, [next_token(seq.token_ids)])
                assert seq.is_finished == finished, "the scheduler ends a sequence at max_tokens, not before"
                if finished:
                    assert seq.is_finished and seq.block_table == []
                    self.finished.append(seq)
        return batch

    def fork_siblings(self, parent: Sequence) -> None:
        for index in range(1, parent.params.n):
            child = Sequence(next(_seq_ids), parent.token_ids[:parent.num_prompt_tokens], parent.num_prompt_tokens,
                             parent.params, index=index)
            self.scheduler.fork(parent, child)

    def check_batch(self, batch: ScheduledBatch, running_before: list[Sequence]) -> None:
        sched = self.scheduler
        assert len(batch.seqs) == len(batch.num_new_tokens)
        assert len({id(s) for s in batch.seqs}) == len(batch.seqs), "a sequence scheduled twice"
        assert sum(batch.num_new_tokens) <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs and len(batch.seqs) <= sched.max_num_seqs
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            assert seq.status is SequenceStatus.RUNNING and seq in sched.running
            assert 1 <= num_new <= seq.num_tokens - seq.num_computed_tokens
            assert len(seq.block_table) >= self.bm.blocks_needed(seq.num_computed_tokens + num_new)
        # Running sequences come first, in order; new ones only when nobody was preempted.
        carried = [s for s in batch.seqs if s in running_before]
        assert batch.seqs[:len(carried)] == carried
        assert carried == [s for s in running_before if s in carried]
        admitted = batch.seqs[len(carried):]
        if admitted:
            assert batch.num_preempted == 0
            assert all(s in batch.seqs for s in running_before), "a running sequence skipped for a new one"
        preempted = [s for s in running_before if s not in sched.running and not s.is_finished]
        assert len(preempted) == batch.num_preempted
        assert list(sched.waiting)[:len(preempted)] == preempted, "preempted sequences go to the front"
        for seq in preempted:
            assert seq.status is SequenceStatus.WAITING
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        if preempted:  # the newest are preempted first
            assert running_before[len(running_before) - len(preempted):] == preempted

    def run(self, max_steps: int = MAX_STEPS) -> int:
        for step in range(max_steps):
            if not self.scheduler.has_unfinished:
                return step
            self.step()
        raise AssertionError(f"not finished after {max_steps} steps: the scheduler is stuck")


def make_scheduler(num_blocks=16, block_size=4, max_num_seqs=8, max_num_batched_tokens=16,
                   prefix_caching=True) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, block_size, prefix_caching), max_num_seqs, max_num_batched_tokens)


def assert_all_blocks_free(bm: BlockManager) -> None:
    assert bm.num_free_blocks == bm.num_blocks
    assert all(b.ref_count == 0 for b in bm.blocks)


# ---- a random workload -----------------------------------------------------------------

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(4, 12))
    capacity = num_blocks * block_size
    requests = []
    for _ in range(draw(st.integers(1, 6))):
        max_tokens = draw(st.integers(1, 5))
        # Some prompts start alike (a burst of one prompt, one system prompt), so that sequences
        # wait for a prefix another is computing. As the engine demands: prompt + max_tokens fits the pool.
        start = draw(st.sampled_from([[], [1, 2, 3, 0, 1, 2, 3, 0], [3, 3, 1, 1, 2, 2, 0, 0]]))
        rest = draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
        prompt = (start + rest)[:min(14, capacity - max_tokens)]
        requests.append((draw(st.integers(0, 6)), prompt, max_tokens, draw(st.integers(1, 2))))
    return dict(block_size=block_size, num_blocks=num_blocks, requests=requests,
                max_num_seqs=draw(st.integers(1, 4)), max_num_batched_tokens=draw(st.integers(1, 16)),
                prefix_caching=draw(st.booleans()))


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workload_respects_limits_and_every_sequence_completes(w):
    sched = make_scheduler(w["num_blocks"], w["block_size"], w["max_num_seqs"], w["max_num_batched_tokens"],
                           w["prefix_caching"])
    runner = FakeRunner(sched)
    pending = sorted(((arrival, i, make_seq(prompt, max_tokens, n))
                      for i, (arrival, prompt, max_tokens, n) in enumerate(w["requests"])), key=lambda r: r[:2])
    firsts = [seq for _, _, seq in pending]
    step = 0
    while pending or sched.has_unfinished:
        while pending and pending[0][0] <= step:
            sched.add(pending.pop(0)[2])
        runner.step()
        step += 1
        assert step < MAX_STEPS, "the scheduler is stuck"

    expected_count = sum(seq.params.n for seq in firsts)
    assert len(runner.finished) == expected_count
    for seq in runner.finished:
        assert seq.finish_reason == "length"
        assert seq.output_token_ids == expected_output(seq.token_ids[:seq.num_prompt_tokens], seq.params.max_tokens)
    assert_all_blocks_free(sched.block_manager)
    assert sum(b.num_preempted for b in runner.batches) == sched.num_preemptions


# ---- budget, chunking and order --------------------------------------------------------

def test_max_num_seqs_caps_the_running_set():
    sched = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(sched)
    seqs = [make_seq([i, i, i], max_tokens=2) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    batch = runner.step()
    assert batch.seqs == seqs[:2]
    assert list(sched.waiting) == [seqs[2]]
    runner.run()
    assert all(seq.is_finished for seq in seqs)


def test_prompt_longer_than_the_budget_is_prefilled_in_chunks():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(sched)
    seq = make_seq(range(10), max_tokens=2)
    sched.add(seq)
    chunks = []
    for _ in range(3):
        batch = runner.step()
        chunks.append(batch.num_new_tokens)
        assert seq.num_output_tokens == (1 if seq.num_computed_tokens == 10 else 0)
    assert chunks == [[4], [4], [2]]
    assert runner.step().num_new_tokens == [1]  # then it decodes
    assert seq.is_finished and seq.output_token_ids == expected_output(list(range(10)), 2)


def test_decode_and_a_prefill_chunk_share_a_step():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(sched)
    first = make_seq([1, 2, 3], max_tokens=8)
    sched.add(first)
    runner.step()  # first's whole prompt
    second = make_seq(range(10), max_tokens=2)
    sched.add(second)
    batch = runner.step()
    assert batch.seqs == [first, second]
    assert batch.num_new_tokens == [1, 3]  # one decode token, the rest of the budget for the prompt
    assert runner.step().num_new_tokens == [1, 3]
    assert second.num_computed_tokens == 6


def test_running_sequences_are_scheduled_before_waiting_ones():
    sched = make_scheduler(max_num_batched_tokens=1)
    runner = FakeRunner(sched)
    old = make_seq([1], max_tokens=3)
    sched.add(old)
    runner.step()
    new = make_seq([2], max_tokens=3)
    sched.add(new)
    for _ in range(2):  # the whole budget goes to the running decode
        assert runner.step().seqs == [old]
        assert list(sched.waiting) == [new]
    assert old.is_finished
    assert runner.step().seqs == [new]


# ---- a prefix that arrives several times at once is computed once ---------------------

def test_a_burst_of_one_prompt_computes_it_once():
    sched = make_scheduler(block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    prompt = [1, 2, 3, 0, 1, 2, 3, 0, 2]  # two full blocks and a token
    burst = [make_seq(prompt, max_tokens=3) for _ in range(4)]
    for seq in burst:
        sched.add(seq)
    first = runner.step()
    assert first.seqs == [burst[0]] and first.num_new_tokens == [9]
    assert list(sched.waiting) == burst[1:]
    second = runner.step()
    assert second.seqs == burst and second.num_new_tokens == [1, 1, 1, 1]  # a decode, three cache hits
    runner.run()
    assert all(seq.output_token_ids == expected_output(prompt, 3) for seq in burst)
    assert [seq.num_cached_tokens for seq in burst] == [0, 8, 8, 8]


def test_a_prompt_that_shares_little_with_one_being_computed_goes_in_at_once():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    a = make_seq([1, 1, 1, 1] + [2] * 9, max_tokens=2)  # shares one block of thirteen tokens
    b = make_seq([1, 1, 1, 1] + [3] * 9, max_tokens=2)
    sched.add(a)
    sched.add(b)
    assert runner.step().seqs == [a, b]
    runner.run()


def test_a_sequence_waiting_for_a_shared_prefix_keeps_its_slot_and_its_place():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    prompt = [2, 2, 1, 1, 3, 3, 0]
    lead, follower = make_seq(prompt, max_tokens=4), make_seq(prompt, max_tokens=4)
    other = make_seq([0, 1, 0, 1, 0], max_tokens=4)
    for seq in (lead, follower, other):
        sched.add(seq)
    assert runner.step().seqs == [lead]  # other does not take the follower's slot
    assert list(sched.waiting) == [follower, other]
    assert runner.step().seqs == [lead, follower]
    assert follower.num_cached_tokens == 4
    runner.run()
    assert other.output_token_ids == expected_output([0, 1, 0, 1, 0], 4)


def test_a_sequence_behind_one_waiting_for_a_shared_prefix_may_go_ahead():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=3, max_num_batched_tokens=64)
    runner = FakeRunner(sched)
    prompt = [2, 2, 1, 1, 3, 3, 0]
    lead, follower, other = make_seq(prompt), make_seq(prompt), make_seq([0, 1, 0, 1, 0])
    for seq in (lead, follower, other):
        sched.add(seq)
    assert runner.step().seqs == [lead, other]
    assert runner.step().seqs == [lead, other, follower]
    runner.run()


def test_a_follower_whose_lead_is_aborted_part_way_computes_the_rest_itself():
    sched = make_scheduler(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=4)
    runner = FakeRunner(sched)
    prompt = [1, 0, 2, 3, 3, 2, 0, 1, 1, 2, 2]
    lead, follower = make_seq(prompt, max_tokens=2), make_seq(prompt, max_tokens=2)
    sched.add(lead)
    sched.add(follower)
    assert runner.step().seqs == [lead]  # its first chunk: one block
    sched.finish(lead, "abort")
    batch = runner.step()
    assert batch.seqs == [follower] and follower.num_cached_tokens == 4
    runner.run()
    assert follower.output_token_ids == expected_output(prompt, 2)


def test_without_prefix_caching_nobody_waits_for_a_shared_prefix():
    sched = make_scheduler(max_num_batched_tokens=64, prefix_caching=False)
    runner = FakeRunner(sched)
    burst = [make_seq([1, 2, 3, 0, 1], max_tokens=2) for _ in range(3)]
    for seq in burst:
        sched.add(seq)
    assert runner.step().seqs == burst
    runner.run()


# ---- preemption -------------------------------------------------------------------------

def test_tiny_pool_preempts_the_newest_sequence_and_everything_completes():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    runner = FakeRunner(sched)
    a, b, c = (make_seq([t, t, t], max_tokens=4) for t in range(3))
    for seq in (a, b, c):
        sched.add(seq)
    runner.step()  # a and b take two blocks each; c waits for a slot
    runner.step()
    assert sched.block_manager.num_free_blocks == 0 and sched.running == [a, b]

    batch = runner.step()  # a's fifth token needs a third block: b, the newest, gives its blocks back
    assert batch.num_preempted == 1 and sched.num_preemptions == 1
    assert batch.seqs == [a]
    assert b.status is SequenceStatus.WAITING
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert list(sched.waiting) == [b, c]
    assert b.num_output_tokens == 2  # its generated tokens are kept, to be recomputed

    runner.run()
    for seq in (a, b, c):
        assert seq.is_finished
        assert seq.output_token_ids == expected_output(seq.token_ids[:3], 4)
    assert_all_blocks_free(sched.block_manager)


def test_the_newest_sequence_preempts_itself_when_it_needs_a_block():
    sched = make_scheduler(num_blocks=3, block_size=2, max_num_seqs=2)
    runner = FakeRunner(sched)
    a, b = make_seq([1, 1, 1], max_tokens=3), make_seq([2, 2], max_tokens=3)
    sched.add(a)
    sched.add(b)
    assert runner.step().num_new_tokens == [3, 2]  # the pool is full
    batch = runner.step()  # a decodes into its second block; b needs a second block and is the newest
    assert batch.seqs == [a] and batch.num_preempted == 1
    assert b.status is SequenceStatus.WAITING and b.block_table == [] and list(sched.waiting) == [b]
    runner.run()
    assert a.output_token_ids == expected_output([1, 1, 1], 3)
    assert b.output_token_ids == expected_output([2, 2], 3)
    assert_all_blocks_free(sched.block_manager)


# ---- forks -----------------------------------------------------------------------------

def test_a_forked_sibling_of_a_block_aligned_prompt_computes_its_last_token():
    sched = make_scheduler(block_size=4)
    runner = FakeRunner(sched)
    parent = make_seq(range(8), max_tokens=2, n=2)
    sched.add(parent)
    runner.step()
    child = sched.waiting[0]
    assert child.index == 1 and child.block_table == parent.block_table[:1]
    batch = runner.step()
    assert batch.seqs == [parent, child]
    assert batch.num_new_tokens == [1, 4]  # the child recomputes its last block, then samples
    runner.run()
    assert child.output_token_ids == parent.output_token_ids == expected_output(list(range(8)), 2)


def test_a_waiting_sibling_holding_blocks_does_not_keep_the_queue_head_out():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=1)
    runner = FakeRunner(sched)
    parent, other = make_seq([0] * 7, max_tokens=1, n=2), make_seq([1, 1, 1], max_tokens=1)
    sched.add(parent)
    sched.add(other)
    runner.step()  # the parent's prompt: its sibling forks off with 3 of the 4 blocks, the parent finishes
    child = sched.waiting[-1]
    assert parent.is_finished and list(sched.waiting) == [other, child]
    assert len(child.block_table) == 3 and sched.block_manager.num_free_blocks == 1

    runner.step()  # other needs 2 blocks: the waiting sibling has to let go of its own
    assert child.block_table == []
    assert runner.step().seqs == [other]
    runner.run()
    assert other.output_token_ids == expected_output([1, 1, 1], 1)
    assert child.output_token_ids == parent.output_token_ids
    assert_all_blocks_free(sched.block_manager)


def test_a_waiting_sibling_holding_blocks_does_not_stop_a_running_sequence_from_growing():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=1, max_num_batched_tokens=2)
    runner = FakeRunner(sched)
    parent, other = make_seq([0] * 5, max_tokens=1, n=2), make_seq([1] * 5, max_tokens=1)
    sched.add(parent)
    sched.add(other)
    for _ in range(3):  # the parent's prompt in chunks of 2, 2 and 1; the sibling keeps 2 blocks
        runner.step()
    child = sched.waiting[-1]
    assert parent.is_finished and len(child.block_table) == 2
    runner.step()
    runner.step()  # other is admitted and fills the two free blocks
    assert other.num_computed_tokens == 4 and child.block_table
    batch = runner.step()  # its last prompt token needs a third block: the sibling's, not a preemption
    assert batch.seqs == [other] and batch.num_preempted == 0
    assert child.block_table == []
    runner.run()
    assert child.output_token_ids == parent.output_token_ids == expected_output([0] * 5, 1)
    assert_all_blocks_free(sched.block_manager)


# ---- finish and abort ------------------------------------------------------------------

def test_finish_a_running_sequence_returns_its_blocks_at_once():
    sched = make_scheduler(max_num_batched_tokens=4)
    runner = FakeRunner(sched)
    seq = make_seq(range(10))
    sched.add(seq)
    runner.step()  # half-way through its prompt
    assert sched.block_manager.num_free_blocks < sched.block_manager.num_blocks
    sched.finish(seq, "abort")
    assert seq.status is SequenceStatus.FINISHED and seq.finish_reason == "abort"
    assert seq not in sched.running and not sched.has_unfinished
    assert_all_blocks_free(sched.block_manager)
    sched.finish(seq, "stop")  # finishing twice changes nothing
    assert seq.finish_reason == "abort"
    assert not runner.step()


def test_finish_a_waiting_sequence_that_holds_blocks_returns_them_at_once():
    sched = make_scheduler(max_num_seqs=1)
    runner = FakeRunner(sched)
    parent = make_seq(range(6), max_tokens=4, n=2)
    sched.add(parent)
    runner.step()
    child = sched.waiting[0]  # forked, queued behind max_num_seqs, sharing the parent's blocks
    assert child.status is SequenceStatus.WAITING and child.block_table
    sched.finish(child, "abort")
    assert child not in sched.waiting and child.block_table == []
    sched.finish(parent, "abort")
    assert not sched.has_unfinished
    assert_all_blocks_free(sched.block_manager)


def test_finish_a_preempted_sequence_removes_it_from_the_queue():
    sched = make_scheduler(num_blocks=4, block_size=2, max_num_seqs=2)
    runner = FakeRunner(sched)
    a, b = make_seq([0, 0, 0], max_tokens=4), make_seq([1, 1, 1], max_tokens=4)
    sched.add(a)
    sched.add(b)
    while not sched.num_preemptions:
        runner.step()
    assert list(sched.waiting) == [b]
    sched.finish(b, "abort")
    assert not sched.waiting and b.is_finished
    runner.run()
    assert a.is_finished and a.finish_reason == "length"
    assert_all_blocks_free(sched.block_manager)


# ---- the length stop -------------------------------------------------------------------

def accepted(max_tokens=None, max_model_len=None, prompt=(1, 2, 3), tokens=(0,), pooling=None, **stops) -> Sequence:
    """A prefilled sequence given `tokens` in one step (with the stops its caller read in them)."""
    sched = make_scheduler()
    sched.max_model_len = max_model_len
    seq = Sequence(next(_seq_ids), list(prompt), len(prompt), SamplingParams(max_tokens=max_tokens, pooling=pooling))
    sched.add(seq)
    while seq.num_computed_tokens < seq.num_tokens:
        sched.update(sched.schedule())
    sched.accept(seq, list(tokens), **stops)
    return seq


def test_the_scheduler_ends_a_sequence_at_max_tokens_or_the_end_of_the_context():
    assert accepted(max_tokens=2, tokens=[0]).finish_reason is None
    assert accepted(max_tokens=2, tokens=[0, 1]).finish_reason == "length"  # a draft and the sampled token
    assert accepted(max_tokens=None, max_model_len=5, tokens=[0]).finish_reason is None
    assert accepted(max_tokens=None, max_model_len=5, tokens=[0, 1]).finish_reason == "length"
    assert accepted(max_tokens=9, max_model_len=4, tokens=[0]).finish_reason == "length"
    assert accepted(max_tokens=0, tokens=[], pooling="last").finish_reason == "length"  # an embedding: no tokens
    assert accepted(max_tokens=None, tokens=[0] * 50).finish_reason is None  # no limit but the caller's stops


def test_what_the_last_token_says_wins_over_the_length_and_the_length_over_a_complete_grammar():
    assert accepted(max_tokens=1, finish_reason="stop").finish_reason == "stop"  # an EOS or a stop string
    assert accepted(max_tokens=1, complete=True).finish_reason == "length"  # the grammar's EOS would come after
    assert accepted(max_tokens=2, complete=True).finish_reason == "stop"
    seq = accepted(max_tokens=1)
    assert seq.is_finished and seq.block_table == []


def test_more_tokens_than_the_length_allows_is_a_bug_in_the_caller():
    with pytest.raises(AssertionError, match="draft_limit"):
        accepted(max_tokens=1, tokens=[0, 1])


# ---- the prefix-cache counters ---------------------------------------------------------

def test_a_prompt_waiting_for_room_counts_its_cache_lookup_once():
    """The head of the queue is looked up again every step it cannot fit (it gives its cached
    prefix back meanwhile); the hit-rate counters must count its prompt once, on admission."""
    sched = make_scheduler(num_blocks=5, block_size=2, max_num_seqs=2)
    runner = FakeRunner(sched)
    bm = sched.block_manager
    shared = [1, 2, 3, 0]
    first = make_seq(shared + [3], max_tokens=3)
    sched.add(first)
    runner.run()  # its two full prompt blocks stay cached
    queries, hits = bm.prefix_queries, bm.prefix_hits

    hog = make_seq([0, 0, 0, 0, 0], max_tokens=2)  # three blocks, decodes into a fourth
    sched.add(hog)
    runner.step()
    second = make_seq(shared + [2, 2, 2], max_tokens=1)  # hits two blocks, needs two more
    sched.add(second)
    waited = 0
    while second.status is SequenceStatus.WAITING:
        runner.step()
        waited += 1
    assert waited > 1, "the workload must make the second prompt wait for room"
    assert bm.prefix_queries - queries == hog.num_prompt_tokens + second.num_prompt_tokens
    assert bm.prefix_hits - hits == second.num_cached_tokens == 4
    runner.run()


# ---- the prefill delay -----------------------------------------------------------------

class StepClock:
    """The scheduler's clock in steps: time moves only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def delayed_scheduler(delay: float) -> tuple[Scheduler, FakeRunner, StepClock]:
    clock = StepClock()
    sched = Scheduler(BlockManager(16, 4), max_num_seqs=4, max_num_batched_tokens=16, prefill_delay_s=delay,
                      clock=clock)
    return sched, FakeRunner(sched), clock


def test_a_new_prompt_waits_for_the_decodes_to_finish_within_the_delay():
    sched, runner, clock = delayed_scheduler(delay=10)
    first = make_seq([1, 1], max_tokens=4)
    sched.add(first)
    runner.step()  # prefilled; it decodes from here on
    second = make_seq([2, 2, 2], max_tokens=2)
    sched.add(second)
    while not first.is_finished:
        clock.now += 1
        assert runner.step().seqs == [first], "a held prompt joined a step while the other decoded"
    assert clock.now < 10
    assert runner.step().seqs == [second]  # nothing decodes any more: it goes in at once
    runner.run()
    assert second.output_token_ids == expected_output([2, 2, 2], 2)


def test_a_held_prompt_goes_in_when_its_delay_is_up_with_everything_that_waited_since():
    sched, runner, clock = delayed_scheduler(delay=3)
    long = make_seq([1, 1], max_tokens=20)
    sched.add(long)
    runner.step()
    held = [make_seq([2, 2], max_tokens=2)]
    sched.add(held[0])
    for _ in range(2):
        clock.now += 1
        held.append(make_seq([3, clock.now], max_tokens=2))
        sched.add(held[-1])
        assert runner.step().seqs == [long]
    clock.now += 1  # the first held prompt has waited 3: all three go in together
    assert runner.step().seqs == [long, *held]
    runner.run()
    assert all(seq.is_finished for seq in [long, *held])


def test_without_a_delay_a_new_prompt_joins_the_next_step():
    sched, runner, _ = delayed_scheduler(delay=0)
    first = make_seq([1, 1], max_tokens=4)
    sched.add(first)
    runner.step()
    second = make_seq([2, 2, 2], max_tokens=2)
    sched.add(second)
    assert runner.step().seqs == [first, second]



def test_gather_prefills_holds_a_backlog_until_a_group_of_slots_is_free():
    assert gather_prefills(num_waiting=10, free_slots=1, num_running=7, group=4)  # one slot: wait for more
    assert not gather_prefills(num_waiting=10, free_slots=4, num_running=4, group=4)  # a group: in they go
    assert not gather_prefills(num_waiting=1, free_slots=1, num_running=7, group=4)  # no backlog: at once
    assert gather_prefills(num_waiting=2, free_slots=1, num_running=7, group=4)  # two wait: one slot is not both
    assert not gather_prefills(num_waiting=10, free_slots=1, num_running=0, group=4)  # nothing runs: never hold
    assert not gather_prefills(num_waiting=10, free_slots=1, num_running=7, group=1)  # group 1: off
    assert gather_prefills(num_waiting=10, free_slots=1, num_running=7, group=4, held_steps=MAX_GATHER_STEPS - 1)
    assert not gather_prefills(num_waiting=10, free_slots=1, num_running=7, group=4, held_steps=MAX_GATHER_STEPS)


def test_a_long_generation_holding_its_slot_keeps_the_backlog_out_only_for_a_bounded_number_of_steps():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64, prefill_group=2)
    runner = FakeRunner(sched)
    long, short = make_seq([1, 1], max_tokens=60), make_seq([1, 2], max_tokens=1)
    sched.add(long)
    sched.add(short)
    runner.step()
    waiting = make_seq([3, 3], max_tokens=2)
    sched.add(waiting)
    sched.add(make_seq([3, 4], max_tokens=2))
    held = 0
    while waiting not in runner.step().seqs:
        held += 1
        assert held <= MAX_GATHER_STEPS, "the backlog waited for a second free slot without end"
    assert held == MAX_GATHER_STEPS  # it did wait for one, that long


def test_past_capacity_prompts_go_in_as_a_group_once_enough_slots_are_free():
    sched = Scheduler(BlockManager(64, 4), max_num_seqs=4, max_num_batched_tokens=64, prefill_group=2)
    runner = FakeRunner(sched)
    running = [make_seq([1, i], max_tokens=3 + 2 * i) for i in range(4)]  # they finish two steps apart
    for seq in running:
        sched.add(seq)
    runner.step()
    backlog = [make_seq([2, i], max_tokens=2) for i in range(4)]
    for seq in backlog:
        sched.add(seq)
    admitted = []  # (prompts admitted, slots that were free) for each step that admitted any
    while not all(seq.is_finished for seq in backlog):
        before = list(sched.running)
        free = 4 - len(before)
        new = [seq for seq in runner.step().seqs if seq not in before]
        if new:
            admitted.append((len(new), free))
    assert [n for n, _ in admitted] == [2, 2] and all(free >= 2 for _, free in admitted), admitted  # never one alone
    runner.run()
    for i, seq in enumerate(backlog):
        assert seq.output_token_ids == expected_output([2, i], 2)
