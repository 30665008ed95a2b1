"""Several micro-batches in the pipeline at once, so its stages work at the same time (vLLM's virtual
engines do the same with one scheduler each; here one scheduler deals the work out).

With one step in flight, stage s idles while the others run it: P stages take turns. The leader
instead keeps up to `depth` (= P) launched steps: once its own stage is done with micro-batch i it
schedules and launches i + 1 while the later stages still work on i, then collects the results in
launch order. Each micro-batch is a disjoint set of sequences: a sequence in flight is `busy` to
the scheduler, which neither schedules nor preempts it until its step is done, so every sequence
still advances one step at a time exactly as with one in flight, and greedy output is unchanged.
Each takes an equal share of the sequences at hand (`micro_batch_cap`), so the stages get even work.

Blocks freed while a micro-batch is in flight (an abort, a preempted idle sequence) may go to the
next micro-batch at once: every stage runs micro-batches in launch order, so their new owner's
writes land after the old owner's reads on every stage.

Speculative decoding keeps one step in flight: drafts are proposed for the running sequences
before a step, from their latest tokens, which a sequence in flight does not have yet.
"""
from __future__ import annotations

import os
from collections import deque

from kaon_runtime.arith import ceil_div
from kaon_runtime.config import EngineConfig
from kaon_runtime.engine.model_runner import LaunchedStep, ModelRunner
from kaon_runtime.engine.scheduler import ScheduledBatch, Scheduler
from kaon_runtime.engine.sequence import Sequence, SequenceStatus

# How many micro-batches to keep in the pipeline; default: as many as stages. 1 turns overlap off
# (for comparison: bench/pipeline.py).
DEPTH_ENV = "KAON_PIPELINE_MICRO_BATCHES"


def pipeline_depth(config: EngineConfig, speculative: bool) -> int:
    if config.pipeline_parallel_size == 1 or speculative:
        return 1
    return max(1, int(os.environ.get(DEPTH_ENV, config.pipeline_parallel_size)))


def micro_batch_cap(num_unfinished: int, max_num_seqs: int, depth: int) -> int:
    """The most sequences one micro-batch takes: an equal share of the work at hand, so that `depth`
    micro-batches split it instead of the first taking everything and leaving the rest idle."""
    return max(1, ceil_div(min(num_unfinished, max_num_seqs), depth))


class InFlight:
    """The launched steps whose results have not been collected, oldest first."""

    def __init__(self, depth: int):
        self.depth = depth
        self.peak = 0  # the most ever in flight at once: overlap happened when it exceeds 1
        self._steps: deque[LaunchedStep] = deque()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def busy(self) -> set[Sequence]:
        return {seq for step in self._steps for seq in step.batch.seqs}

    def fill(self, scheduler: Scheduler, runner: ModelRunner) -> None:
        """Launch micro-batches until `depth` are in flight or nothing is left to schedule."""
        while len(self._steps) < self.depth:
            cap = micro_batch_cap(len(scheduler.running) + len(scheduler.waiting), scheduler.max_num_seqs, self.depth)
            batch = scheduler.schedule(self.busy, cap)
            if not batch:
                return
            self.push(runner.launch(batch))

    def push(self, step: LaunchedStep) -> None:
        assert not self.busy & set(step.batch.seqs), "a sequence is in two micro-batches in flight"
        self._steps.append(step)
        self.peak = max(self.peak, len(self._steps))

    def pop(self) -> LaunchedStep:
        return self._steps.popleft()


def without_finished(batch: ScheduledBatch) -> ScheduledBatch:
    """The batch less the sequences that finished (were aborted) while it was in flight: their blocks
    are gone, so nothing of the step is recorded for them."""
    kept = [i for i, seq in enumerate(batch.seqs) if seq.status is not SequenceStatus.FINISHED]
    if len(kept) == len(batch.seqs):
        return batch
    return ScheduledBatch([batch.seqs[i] for i in kept], [batch.num_new_tokens[i] for i in kept],
                          batch.num_preempted, batch.running_adapters)
