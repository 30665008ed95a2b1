"""Continuous batching: which sequences run this step, and how many tokens each.

Every step has a token budget and a cap on running sequences. Running sequences go
first (a decode costs one token plus its speculative drafts, an unfinished prefill its
next chunk), then waiting ones in arrival order. Drafts that do not fit the budget or the
free blocks are dropped before anything else gives way. A sequence that finds no free block preempts the newest running
sequence, which gives its blocks back and is recomputed later (its own prefix, still
in the cache unless evicted, softens the cost). Before anyone is preempted, waiting sequences
that hold blocks (forked siblings) give them back.

The prefix cache only holds what earlier steps computed, so prompts that share a prefix and
arrive together (a burst of one prompt, or of one system prompt, on a cold cache) would each
compute it in the same step. A waiting prompt whose next blocks a running sequence is
computing sits out until they are cached, when that is at least half of its own work
(wait_for_shared_prefix), keeping its slot and its place in line.

With a prefill delay, new prompts wait while others decode, up to the delay after the first
in line arrived (hold_prefills): every decoding stream waits for the prefill chunks of its
step, so a busy server that admits each new prompt at once stretches every stream's
inter-token time by each newcomer's prefill. Held, the prompts go in together when the decodes
finish or the first in line is due.

Past capacity (a backlog), prompts go in as a group once `prefill_group` slots are free
(gather_prefills), not one per freed slot: on a CPU a step pays about the same for one prompt
as for several, so one at a time costs throughput.

The scheduler is also the one owner of a sequence's progress: after each step `update` records
the K/V the forward pass computed, `accept` appends the verified tokens (rolling back rejected
drafts) and ends the sequence when it should, `finish` retires a sequence; `fork` and
`attach_drafts` are the other ways in. The block manager places blocks and returns counts;
nothing else moves a sequence's counters. So the length stop (max_tokens, or the context full)
is decided here, from the counts, with the stops the engine reads in the tokens (an EOS, a stop
token or string, a complete grammar: it needs the tokenizer and the text) handed to `accept`.

Over 300 lines for a stated reason: admission, chunking, preemption and the pure decisions beside them
(hold_prefills, gather_prefills, wait_for_shared_prefix) read and change one queue state; the pure
decisions are the next to move out if it grows.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.sequence import Sequence, SequenceStatus


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each sequence computes this step
    num_preempted: int = 0
    running_adapters: set[int] = field(default_factory=set)  # LoRA ids of every running sequence: they keep slots

    def __bool__(self) -> bool:
        return bool(self.seqs)


MAX_GATHER_STEPS = 16  # gather_prefills keeps a backlog out for at most this many steps in a row

class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 prefill_delay_s: float = 0.0, clock: Callable[[], float] = time.monotonic, max_loras: int = 0,
                 max_model_len: int | None = None, prefill_group: int = 1):
        self.block_manager = block_manager
        self.prefill_group = prefill_group  # backlogged prompts go in when this many slots are free (gather_prefills)
        self._held_steps = 0  # steps in a row that gather_prefills kept the backlog out
        self.max_model_len = max_model_len  # the context: a sequence this long ends ("length"); None: no limit
        self.max_loras = max_loras  # distinct LoRA adapters running at once (the slots they run from)
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
        self.block_manager.prefetch(seq)  # lower KV tiers lift its prompt's blocks while it waits

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue `child` (a sibling of an n > 1 request) sharing the parent's computed full blocks;
        it joins the parent at once, without the prefill delay."""
        child.num_computed_tokens = child.num_cached_tokens = self.block_manager.fork(parent, child)
        child.prefill_due = float("-inf")
        self.add(child)

    def attach_drafts(self, seq: Sequence, token_ids: list[int], probs: torch.Tensor | None) -> None:
        """Speculative tokens for the sequence's next step, computed after its own and kept only if verified."""
        seq.draft_token_ids, seq.draft_probs = token_ids, probs

    def schedule(self, busy: Collection[Sequence] = (), max_seqs: int | None = None) -> ScheduledBatch:
        """The next batch. Under pipeline parallelism several are in flight at once: `busy` are the
        sequences of those (never scheduled again, nor preempted, until their step is done) and
        `max_seqs` caps this one's sequences (engine.micro_batches)."""
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        cap = self.max_num_seqs if max_seqs is None else max_seqs
        i = 0
        while i < len(self.running) and budget > 0 and len(batch.seqs) < cap:
            seq = self.running[i]
            if seq in busy:
                i += 1
                continue
            # Without drafts _fit_drafts is this min; the call and its trims are skipped for the common row.
            pending = seq.num_tokens - seq.num_computed_tokens
            wanted = _fit_drafts(seq, budget) if seq.draft_token_ids or seq.draft_probs is not None else min(
                pending, budget)
            num_new = self._make_room(seq, wanted, batch, busy)
            if num_new is None:  # seq itself was preempted: it was the newest, nothing is left after it
                break
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            i += 1
        # Admitting new work right after a preemption would only thrash the cache.
        gathering = bool(self.waiting) and gather_prefills(len(self.waiting), self.max_num_seqs - len(self.running),
                                                           len(self.running), self.prefill_group, self._held_steps)
        self._held_steps = self._held_steps + 1 if gathering else 0
        if batch.num_preempted == 0 and not gathering and not (self.waiting and hold_prefills(
                self.clock(), _due(self.waiting[0]), len(self.running))):
            budget = self._admit_waiting(batch, budget, cap)
        batch.running_adapters = {s.lora_id for s in self.running if s.lora_id}
        return batch

    def _make_room(self, seq: Sequence, num_new: int, batch: ScheduledBatch, busy: Collection[Sequence]) -> int | None:
        """Find blocks for `seq`'s next `num_new` tokens: drop its drafts first (they are optional), then
        take back what waiting sequences hold, then preempt the newest running sequence not in flight
        (not `busy`), until they fit. Returns the tokens that fit, or None when `seq` itself had to be preempted."""
        while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + num_new):
            if seq.draft_token_ids:
                num_new = _fit_drafts(seq, 1)
            elif not self._release_waiting_blocks():
                victim = self.running.pop(max(i for i, s in enumerate(self.running) if s not in busy))
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is seq:
                    return None
        return num_new

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, cap: int) -> int:
        """Admit waiting sequences in arrival order while the budget, the slots and the blocks
        last. One whose next blocks another sequence is computing now waits for them
        (`wait_for_shared_prefix`) and keeps its slot and its place in line; those behind it
        may go ahead."""
        if not self.waiting or len(self.running) >= self.max_num_seqs:
            return budget
        bm = self.block_manager
        pending = {h for seq in self.running for h in bm.pending_hashes(seq)}
        deferred: list[Sequence] = []
        num_sharing = 0  # of the deferred, those waiting for a shared prefix: they keep their slot
        adapters = {s.lora_id for s in self.running if s.lora_id}
        while (self.waiting and budget > 0 and len(self.running) + num_sharing < self.max_num_seqs
               and len(batch.seqs) < cap):
            seq = self.waiting[0]
            if seq.lora_id and seq.lora_id not in adapters and len(adapters) >= self.max_loras:
                deferred.append(self.waiting.popleft())  # every adapter slot is taken: until one frees up
                continue
            if not seq.block_table:
                seq.num_computed_tokens = seq.num_cached_tokens = bm.allocate_prefix(seq)
            uncached = seq.num_tokens - seq.num_computed_tokens
            if pending and wait_for_shared_prefix(bm.shared_pending_tokens(seq, pending), uncached):
                self._free_blocks(seq)  # looked up again next step, when more of its prefix is cached
                deferred.append(self.waiting.popleft())
                num_sharing += 1
                continue
            num_new = min(uncached, budget)
            if not bm.ensure_slots(seq, seq.num_computed_tokens + num_new):
                self._release_waiting_blocks()  # this one's cached prefix too, until there is room
                break
            self.waiting.popleft()
            bm.record_admission(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.lora_id:
                adapters.add(seq.lora_id)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
            pending.update(bm.pending_hashes(seq))
        self.waiting.extendleft(reversed(deferred))  # back at the front, in their order
        return budget

    # ---- after the step ------------------------------------------------------------------

    def update(self, batch: ScheduledBatch) -> None:
        """The forward pass ran: each sequence's chunk is in the cache, and its full blocks are
        registered. Drafts' K/V counts only once verified (`accept`), so no block holding a
        rejected token is ever registered in the prefix cache."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += num_new - len(seq.draft_token_ids)
            self.block_manager.commit(seq)

    def accept(self, seq: Sequence, token_ids: list[int], logprobs: list[dict[int, float]] | None = None,
               finish_reason: str | None = None, complete: bool = False) -> None:
        """Append what a sequence's step produced: its kept drafts, then the sampled token; end the
        sequence if it should. The kept drafts' K/V was computed this step; the rejected drafts'
        slots go back to the pool.

        The caller reads the tokens and cuts them at the first that ends the sequence: with
        `finish_reason` ("stop": an EOS, a stop token or string), or `complete` (a grammar that
        can take nothing more). The length stop is decided here, between the two: a sequence at
        max_tokens or the end of the context ends with "length" unless its last token stopped it;
        a complete grammar ends it as the EOS it would force next would, a token later, so the
        length stop comes first."""
        num_drafts = len(seq.draft_token_ids)
        left = self.tokens_left(seq)
        assert len(token_ids) <= left, "drafts are cut to fit the length (drafter.draft_limit)"
        if num_drafts or seq.draft_probs is not None:
            seq.keep_drafts(0)
        seq.token_ids.extend(token_ids)
        if logprobs is not None:
            seq.logprobs.extend(logprobs)
        # Both limits in tokens_left shrink by one per token, so what is left now is left - len(token_ids).
        reason = finish_reason or ("length" if left - len(token_ids) <= 0 else None) or ("stop" if complete else None)
        if reason is not None:
            self.finish(seq, reason)
        elif num_drafts:
            seq.num_computed_tokens = seq.num_tokens - 1
            self.block_manager.commit(seq)
            self.block_manager.truncate(seq)

    def tokens_left(self, seq: Sequence) -> int | float:
        """How many more tokens the sequence may take before its length stop (inf: no limit)."""
        return length_left(seq.num_tokens, seq.num_output_tokens, seq.params.max_tokens, self.max_model_len)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Retire a sequence (finished or aborted) and return its blocks at once."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free_blocks(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _free_blocks(self, seq: Sequence) -> None:
        """Give the sequence's blocks back; what they held must be computed again."""
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0

    def _release_waiting_blocks(self) -> bool:
        """Free the blocks waiting sequences hold (forked siblings share their parent's prompt).

        Idle, they would otherwise keep the head of the queue or a running sequence from growing
        forever. They get their prefix back from the cache when admitted. Returns whether any
        blocks were released.
        """
        released = False
        for seq in self.waiting:
            if seq.block_table:
                self._free_blocks(seq)
                released = True
        return released

    def _preempt(self, seq: Sequence) -> None:
        self._free_blocks(seq)
        seq.keep_drafts(0)
        seq.status = SequenceStatus.WAITING
        seq.prefill_due = float("-inf")  # it was running: back as soon as there is room
        self.waiting.appendleft(seq)
        self.num_preemptions += 1


def hold_prefills(now: float, head_due: float, num_running: int) -> bool:
    """Whether waiting prompts stay out of this step: only while others run, and only until the
    first in line is due (its arrival plus the delay)."""
    return num_running > 0 and now < head_due


def gather_prefills(num_waiting: int, free_slots: int, num_running: int, group: int, held_steps: int = 0,
                    max_held_steps: int = MAX_GATHER_STEPS) -> bool:
    """Whether backlogged prompts stay out of this step until `group` slots are free, so that their prefills
    share one step. A step that computes a prompt beside the decodes costs, on a CPU, about what one
    computing a group of them costs (the weights are read or widened once per step either way), so past
    capacity, when every freed slot is taken at once by the next in line, each prompt gets a step of its
    own and throughput falls by a third (8 slots, 128+32-token requests, 2-vCPU Xeon: 0.99 vs 1.46 req/s).
    Never holds while nothing runs, nor when fewer wait than are free (below capacity nothing waits), nor
    past `max_held_steps` steps in a row (long generations that free no slot for a while)."""
    return num_running > 0 and free_slots < min(group, num_waiting) and held_steps < max_held_steps


def wait_for_shared_prefix(shared_tokens: int, uncached_tokens: int) -> bool:
    """Whether a waiting sequence sits out this step because another sequence is computing
    `shared_tokens` of its prompt right now (a burst of one prompt, or of one system prompt,
    arriving before any of it is cached). Admitted at once, it would compute them again in the
    same step; a step later it finds them cached. Waiting costs it one step (or the few a
    chunked prefill takes) and saves the shared tokens' compute for every sequence in the
    step, so it waits only when they are at least half of what it would compute."""
    return shared_tokens > 0 and 2 * shared_tokens >= uncached_tokens


def length_left(num_tokens: int, num_output_tokens: int, max_tokens: int | None,
                max_model_len: int | None) -> int | float:
    """Tokens a sequence may still generate: the rest of its max_tokens and of the context, each
    None when unlimited (inf when both are). At 0 it ends with finish_reason "length"."""
    left: int | float = float("inf")
    if max_tokens is not None:
        left = max_tokens - num_output_tokens
    if max_model_len is not None:
        left = min(left, max_model_len - num_tokens)
    return max(left, 0)


def _due(seq: Sequence) -> float:
    """When a waiting sequence goes in anyway; `add` sets it for every queued sequence."""
    assert seq.prefill_due is not None, f"sequence {seq.seq_id} was queued without add()"
    return seq.prefill_due


def _fit_drafts(seq: Sequence, budget: int) -> int:
    """Tokens the sequence computes this step within `budget`, dropping the drafts that do not fit."""
    pending = seq.num_tokens - seq.num_computed_tokens
    num_new = min(pending + len(seq.draft_token_ids), budget)
    seq.keep_drafts(max(num_new - pending, 0))
    return num_new
