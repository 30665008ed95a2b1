"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget and a cap on running sequences. Running sequences go
first (a decode costs one token plus its speculative drafts, an unfinished prefill its
next chunk), then waiting ones in arrival order. Drafts that do not fit the budget or the
free blocks are dropped before anything else gives way. A sequence that finds no free block preempts the newest running
sequence, which gives its blocks back and is recomputed later (its own prefix, still
in the cache unless evicted, softens the cost). Before anyone is preempted, waiting sequences
that hold blocks (forked siblings) give them back.

With a prefill delay, new prompts wait while others decode, up to the delay after the first
in line arrived (hold_prefills): every decoding stream waits for the prefill chunks of its
step, so a busy server that admits each new prompt at once stretches every stream's
inter-token time by each newcomer's prefill. Held, the prompts go in together when the decodes
finish or the first in line is due.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    num_preempted: int = 0

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_delay_s = prefill_delay_s
        self.clock = clock
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        if seq.prefill_due is None:
            seq.prefill_due = self.clock() + self.prefill_delay_s
        self.waiting.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = self._make_room(seq, _fit_drafts(seq, budget), batch)
            if num_new is None:  # seq itself was preempted: it was the newest, nothing is left after it
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        # Admitting new work right after a preemption would only thrash the cache.
        if batch.num_preempted == 0 and not (self.waiting and hold_prefills(
                self.clock(), self.waiting[0].prefill_due, len(self.running))):
            budget = self._admit_waiting(batch, budget)
        return batch

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> int | None:
        """Find blocks for `seq`'s next `num_new` tokens: drop its drafts first (they are optional), then
        take back what waiting sequences hold, then preempt the newest running sequence, until they fit.
        Returns the tokens that fit, or None when `seq` itself had to be preempted."""
        while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
            if seq.draft_token_ids:
                num_new = _fit_drafts(seq, 1)
            elif not self._release_waiting_blocks():
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    return None
        return num_new

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if not seq.block_table:
                self.block_manager.allocate_prefix(seq)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self._release_waiting_blocks()  # this one's cached prefix too, until there is room
                break
            self.waiting.popleft()
            self.block_manager.record_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and return its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release_waiting_blocks(self) -> bool:
        """Free the blocks waiting sequences hold (forked siblings share their parent's prompt).

        Idle, they would otherwise keep the head of the queue or a running sequence from growing
        forever. They get their prefix back from the cache when admitted. Returns whether any
        blocks were released.
        """
        released = False
        for seq in self.waiting:
            if seq.block_table:
                self.block_manager.free(seq)
                released = True
        return released

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.keep_drafts(0)
        seq.status = SequenceStatus.WAITING
        seq.prefill_due = float("-inf")  # it was running: back as soon as there is room
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def hold_prefills(now: float, head_due: float, num_running: int) -> bool:
    """Whether waiting prompts stay out of this step: only while others run, and only until the
    first in line is due (its arrival plus the delay)."""
    return num_running > 0 and now < head_due


def _fit_drafts(seq: Sequence, budget: int) -> int:
    """Tokens the sequence computes this step within `budget`, dropping the drafts that do not fit."""
    pending = seq.num_tokens - seq.num_computed_tokens
    num_new = min(pending + len(seq.draft_token_ids), budget)
    seq.keep_drafts(max(num_new - pending, 0))
    return num_new
