"""A scheduled batch flattened into what the model needs for one step, as plain lists.

Rank 0 builds the plan; under tensor parallelism it is also what the other ranks receive,
so it holds nothing but token ids, positions and cache addresses: every rank turns it into
tensors on its own device and runs the same forward pass.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from kaon_runtime.arith import ceil_div
from kaon_runtime.engine.scheduler import ScheduledBatch
from kaon_runtime.engine.sequence import Sequence


@dataclass(slots=True)
class StepPlan:
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # where each token's K/V goes
    decode_tables: list[list[int]] = field(default_factory=list)  # per one-token sequence
    decode_lens: list[int] = field(default_factory=list)
    decode_seq_ids: list[int] = field(default_factory=list)  # whose each decode table is (engine.step_tensors)
    prefills: list[tuple[int, int, int, list[int]]] = field(default_factory=list)  # start, length, context, table
    sample_rows: list[int] = field(default_factory=list)  # rows whose logits are wanted
    # Rows that score the next prompt token, for requests asking for prompt logprobs (after the
    # sample rows in the logits); per scoring sequence: its index in the batch, first row, count.
    prompt_rows: list[int] = field(default_factory=list)
    prompt_spans: list[tuple[int, int, int]] = field(default_factory=list)
    # Per embedding sequence in the step: its index in the batch, its chunk's first row and length
    # (engine/pooling.py keeps their final hidden states).
    pool_spans: list[tuple[int, int, int]] = field(default_factory=list)
    lora_slots: list[int] = field(default_factory=list)  # per token, its adapter's slot (-1: base); empty: none
    # Under tensor parallelism: the adapters rank 0 put in slots for this step, (slot, weights), which
    # the other ranks load too (engine.lora_pool's loads_for_plan); empty on one rank.
    lora_loads: list[tuple[int, dict]] = field(default_factory=list)

    def padded_decode_tables(self) -> list[list[int]]:
        """The decode block tables as one rectangle, short rows padded with block 0 (never read)."""
        widest = max(map(len, self.decode_tables))
        return [t + [0] * (widest - len(t)) for t in self.decode_tables]


def plan_step(batch: ScheduledBatch, block_size: int,
              lora_slots: dict[int, int] | None = None) -> tuple[StepPlan, list[Sequence]]:
    """The plan, and the sequences whose chunk reaches their end (k + 1 sample rows each, k drafts).
    `lora_slots`: the slot of each running adapter (by lora id), when any sequence has one."""
    # Decodes (one new token) first so their rows form one batched attention call.
    order = sorted(range(len(batch.seqs)), key=lambda i: batch.num_new_tokens[i] != 1)
    bs = block_size
    plan, sampling_seqs = StepPlan(), []
    for i in order:
        seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
        if num_new == 1 and not seq.draft_token_ids and not _scores_or_pools(seq):
            if _plan_decode(plan, seq, bs, lora_slots):
                sampling_seqs.append(seq)
            continue
        # Drafts ride along like a short prefill chunk; their K/V counts only once verified.
        tokens = seq.token_ids + seq.draft_token_ids if seq.draft_token_ids else seq.token_ids
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        table = seq.block_table[:ceil_div(end, bs)]
        query_start = len(plan.input_ids)
        plan.input_ids.extend(tokens[start:end])
        plan.positions.extend(range(start, end))
        plan.slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
        if lora_slots:
            plan.lora_slots.extend([lora_slots.get(seq.lora_id, -1)] * num_new)
        scored = range(start, min(end, seq.num_prompt_tokens - 1)) if wants_prompt_logprobs(seq) else range(0)
        if scored:  # row p holds the logits that predict prompt token p + 1
            plan.prompt_spans.append((i, scored.start, len(scored)))
            plan.prompt_rows.extend(query_start + p - start for p in scored)
        if seq.params.pooling is not None:
            plan.pool_spans.append((i, query_start, num_new))
        if num_new == 1:
            plan.decode_tables.append(table)
            plan.decode_lens.append(end)
            plan.decode_seq_ids.append(seq.seq_id)
        else:
            plan.prefills.append((query_start, num_new, end, table))
        if end == len(tokens):  # the chunk reaches the end: its last logits pick a token
            last = len(plan.input_ids)
            plan.sample_rows.extend(range(last - 1 - len(seq.draft_token_ids), last))
            sampling_seqs.append(seq)
    return plan, sampling_seqs


def _plan_decode(plan: StepPlan, seq: Sequence, bs: int, lora_slots: dict[int, int] | None) -> bool:
    """The plan's share of a sequence computing one token, no drafts, no prompt scoring or pooling: what the
    general loop body above does for it, without the ranges it builds for chunks (the common row of a step).
    Whether the row samples (the token is the sequence's last)."""
    pos = seq.num_computed_tokens
    table = seq.block_table[:pos // bs + 1]
    samples = pos + 1 == len(seq.token_ids)
    if samples:
        plan.sample_rows.append(len(plan.input_ids))
    plan.input_ids.append(seq.token_ids[pos])
    plan.positions.append(pos)
    plan.slots.append(table[pos // bs] * bs + pos % bs)
    if lora_slots:
        plan.lora_slots.append(lora_slots.get(seq.lora_id, -1))
    plan.decode_tables.append(table)
    plan.decode_lens.append(pos + 1)
    plan.decode_seq_ids.append(seq.seq_id)
    return samples


def _scores_or_pools(seq: Sequence) -> bool:
    return seq.params.prompt_logprobs is not None or seq.params.pooling is not None


def wants_prompt_logprobs(seq: Sequence) -> bool:
    """The first completion of a request asking for prompt logprobs (its siblings share the prompt)."""
    return seq.params.prompt_logprobs is not None and seq.index == 0
