"""Micro-batches in flight through a pipeline (engine.micro_batches): how the work is dealt out, and that a
sequence is never in two micro-batches at once, driven by hand with the real scheduler and no model."""
from __future__ import annotations

import itertools

import pytest

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.micro_batches import InFlight, micro_batch_cap, without_finished
from kaon_runtime.engine.model_runner import LaunchedStep
from kaon_runtime.engine.scheduler import ScheduledBatch, Scheduler
from kaon_runtime.engine.sequence import Sequence, SequenceStatus
from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.sampling import SamplingParams

_ids = itertools.count()


def make_seq(prompt_len: int, max_tokens: int) -> Sequence:
    tokens = [(7 * i) % 50 + 1 for i in range(prompt_len)]
    return Sequence(next(_ids), tokens, prompt_len, SamplingParams(max_tokens=max_tokens))


class LaunchOnly:
    """Stands in for the model runner: a launch records the micro-batch and computes nothing."""

    def __init__(self):
        self.launched: list[list[Sequence]] = []

    def launch(self, batch: ScheduledBatch) -> LaunchedStep:
        self.launched.append(list(batch.seqs))
        return LaunchedStep(batch, StepPlan(), [], None, None)


def test_each_micro_batch_takes_an_equal_share_of_the_work_at_hand():
    assert micro_batch_cap(16, 256, 2) == 8
    assert micro_batch_cap(5, 256, 2) == 3
    assert micro_batch_cap(300, 256, 2) == 128  # never more than the engine runs at once
    assert micro_batch_cap(1, 256, 4) == 1
    assert micro_batch_cap(0, 256, 2) == 1


@pytest.mark.parametrize("num_blocks", [64, 9])  # 9 blocks of 4 tokens: sequences are preempted
def test_no_sequence_is_in_two_micro_batches_in_flight(num_blocks):
    scheduler = Scheduler(BlockManager(num_blocks, 4, enable_prefix_caching=True), max_num_seqs=6,
                          max_num_batched_tokens=12)
    seqs = [make_seq(3 + 5 * (i % 3), max_tokens=4 + i % 3) for i in range(8)]
    for seq in seqs:
        scheduler.add(seq)
    in_flight, runner = InFlight(depth=2), LaunchOnly()
    for _ in range(500):
        if not scheduler.has_unfinished:
            break
        in_flight.fill(scheduler, runner)
        busy = in_flight.busy
        assert sum(len(runner.launched[-1 - i]) for i in range(len(in_flight))) == len(busy), \
            "a sequence is in two micro-batches in flight"
        assert all(seq.status is SequenceStatus.RUNNING for seq in busy), "a sequence in flight was preempted"
        step = in_flight.pop()
        scheduler.update(step.batch)
        for seq in step.batch.seqs:
            if seq.num_computed_tokens == seq.num_tokens:  # its chunk reached the end: it gains a token
                done = seq.num_output_tokens + 1 >= seq.params.max_tokens
                scheduler.accept(seq, [3], None, "length" if done else None)
    assert not scheduler.has_unfinished
    assert in_flight.peak == 2
    assert all(seq.num_output_tokens == seq.params.max_tokens for seq in seqs)
    if num_blocks == 9:
        assert scheduler.num_preemptions > 0


def test_an_aborted_sequence_leaves_its_micro_batch_unrecorded():
    kept, aborted = make_seq(4, 2), make_seq(4, 2)
    aborted.status = SequenceStatus.FINISHED
    batch = ScheduledBatch([kept, aborted], [4, 4])
    assert without_finished(batch).seqs == [kept] and without_finished(batch).num_new_tokens == [4]
