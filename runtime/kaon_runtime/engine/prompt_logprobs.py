"""Prompt logprobs: how likely the model found each prompt token, given the tokens before it.

Evaluation harnesses score answers this way (echo + logprobs on /v1/completions). The rows come
from the prefill itself: a sequence that asks keeps the logits of every prompt position, not only
the last (engine/step_plan.py lists them after the sample rows), so scoring costs no extra pass.
Prefix-cache hits would skip positions, so such a sequence never reuses cached blocks
(engine/block_manager.py).
"""
from __future__ import annotations

import torch

from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.engine.step_plan import StepPlan
from kaon_runtime.layers.sampler import logprobs_of


def record_prompt_logprobs(plan: StepPlan, seqs: list[Sequence], logits: torch.Tensor | None) -> torch.Tensor | None:
    """Store the prompt logprobs of the plan's prompt rows on their sequences (`seqs`: the batch's,
    in its order); return the logits of the sample rows alone (None when there are none)."""
    if not plan.prompt_rows or logits is None:
        return logits
    num_sample = len(plan.sample_rows)
    owners = [(seqs[i], first, count) for i, first, count in plan.prompt_spans]
    targets = [t for seq, first, count in owners for t in seq.token_ids[first + 1:first + 1 + count]]
    k = max(seq.params.prompt_logprobs or 0 for seq, _, _ in owners)
    scored = logprobs_of(logits[num_sample:].float(), torch.tensor(targets, device=logits.device), k)
    at = 0
    for seq, first, count in owners:
        for j in range(count):
            seq.prompt_logprobs[first + 1 + j] = scored[at + j]  # keyed by position: a recompute overwrites
        at += count
    return logits[:num_sample] if num_sample else None


def prompt_logprobs_list(seq: Sequence) -> list[dict[int, float] | None]:
    """One entry per prompt token, None for the first (nothing precedes it)."""
    return [None] + [seq.prompt_logprobs.get(p) for p in range(1, seq.num_prompt_tokens)]


def sample_rows_only(plan: StepPlan, logits: torch.Tensor | None) -> torch.Tensor | None:
    """The logits of the sample rows, for a caller that does not record prompt logprobs (the drafter)."""
    if not plan.prompt_rows or logits is None:
        return logits
    return logits[:len(plan.sample_rows)] if plan.sample_rows else None
