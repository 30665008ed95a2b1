"""Logits processing before sampling, as vLLM's clients expect it: min_tokens, logit_bias,
repetition/frequency/presence penalties, min_p.

Every operation is batched over the rows that need it: the token histories become one padded
tensor and counts come from one scatter, so the cost per step does not grow with a Python loop
over rows on the device. Rows that ask for none of it are not touched (and a batch with none
returns the logits as they are).

Order, as vLLM applies it: banned tokens (min_tokens, bad_words), allowed_token_ids, logit_bias, repetition
penalty, frequency and presence penalties; then min_p, which depends on the temperature the sampler applies next.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kaon_runtime.sampling import SamplingParams


@dataclass(slots=True)
class RowHistory:
    """What one logits row's adjustments read: its request's settings and the tokens so far."""

    params: SamplingParams
    output_token_ids: list[int]  # generated before this row's token (drafts included)
    prompt_token_ids: list[int] = field(default_factory=list)  # read only by repetition_penalty
    banned_token_ids: list[int] = field(default_factory=list)  # min_tokens not reached: EOS and stop ids


def row_history(params: SamplingParams, token_ids: list[int], num_prompt_tokens: int,
                eos_token_ids: list[int]) -> RowHistory | None:
    """The history a sequence's next row reads; None when its request asks for no adjustment."""
    if not needs_adjusting(params):
        return None
    output = token_ids[num_prompt_tokens:]
    banned = [] if len(output) >= params.min_tokens else (
        ([] if params.ignore_eos else list(eos_token_ids)) + list(params.stop_token_ids))
    banned += bad_word_bans(params.bad_words_token_ids or [], output)
    prompt = token_ids[:num_prompt_tokens] if params.repetition_penalty != 1.0 else []
    return RowHistory(params, list(output), prompt, banned)


def needs_adjusting(params: SamplingParams) -> bool:
    return bool(params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or params.min_p > 0 or params.min_tokens > 0
                or params.allowed_token_ids is not None or params.bad_words_token_ids)


def bad_word_bans(bad_words: list[list[int]], output: list[int]) -> list[int]:
    """The tokens a row may not take next (vLLM's bad_words rule): a one-token word always; a longer word's last
    token where the output so far ends with the word's other tokens."""
    return [word[-1] for word in bad_words
            if word and (len(word) == 1 or (len(output) >= len(word) - 1
                                             and output[len(output) - len(word) + 1:] == word[:-1]))]


def adjust_logits(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    """logits [N, V] float32, one RowHistory per row -> the adjusted logits (a new tensor when any row changes)."""
    chosen = [i for i, r in enumerate(rows) if needs_adjusting(r.params)]
    if not chosen:
        return logits
    index = torch.tensor(chosen, device=logits.device)
    picked = [rows[i] for i in chosen]
    logits = logits.clone()
    logits[index] = _adjust(logits[index], picked)
    return logits


def _adjust(logits: torch.Tensor, rows: list[RowHistory]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    logits = _add_sparse(logits, [r.banned_token_ids for r in rows], [[float("-inf")] * len(r.banned_token_ids)
                                                                        for r in rows])
    logits = _only_allowed(logits, [r.params.allowed_token_ids for r in rows])
    biases = [r.params.logit_bias or {} for r in rows]
    logits = _add_sparse(logits, [list(b) for b in biases], [list(b.values()) for b in biases])
    repetition = torch.tensor([r.params.repetition_penalty for r in rows], device=device)
    frequency = torch.tensor([r.params.frequency_penalty for r in rows], device=device)
    presence = torch.tensor([r.params.presence_penalty for r in rows], device=device)
    counts = token_counts([r.output_token_ids for r in rows], vocab, device)
    if bool((repetition != 1.0).any()):
        seen = (counts > 0) | (token_counts([r.prompt_token_ids for r in rows], vocab, device) > 0)
        penalty = repetition[:, None].expand_as(logits)
        # Seen tokens become less likely whatever their sign: divide positive logits, multiply negative ones.
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * counts - presence[:, None] * (counts > 0).to(logits.dtype)
    return _min_p(logits, [r.params for r in rows])


def _only_allowed(logits: torch.Tensor, allowed: list[list[int] | None]) -> torch.Tensor:
    """-inf everywhere but the allowed token ids, in the rows that name some (vLLM's allowed_token_ids)."""
    if all(a is None for a in allowed):
        return logits
    keep = torch.ones_like(logits, dtype=torch.bool)
    for i, ids in enumerate(allowed):
        if ids is not None:
            keep[i] = False
            keep[i, torch.tensor(ids, dtype=torch.long, device=logits.device)] = True
    return logits.masked_fill(~keep, float("-inf"))


def token_counts(histories: list[list[int]], vocab: int, device) -> torch.Tensor:
    """[N, V] float: how often each token occurs in each row's history (one scatter for all rows)."""
    width = max((len(h) for h in histories), default=0)
    counts = torch.zeros(len(histories), vocab + 1, device=device)
    if width:
        # Padding points at an extra column, dropped afterwards.
        padded = torch.tensor([h + [vocab] * (width - len(h)) for h in histories], device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
    return counts[:, :vocab]


def _add_sparse(logits: torch.Tensor, ids: list[list[int]], values: list[list[float]]) -> torch.Tensor:
    """Add values[i][j] to logits[i, ids[i][j]] for every row at once."""
    row_index = [i for i, row in enumerate(ids) for _ in row]
    if not row_index:
        return logits
    flat_ids = [t for row in ids for t in row]
    flat_values = [v for row in values for v in row]
    device = logits.device
    return logits.index_put((torch.tensor(row_index, device=device), torch.tensor(flat_ids, device=device)),
                            torch.tensor(flat_values, device=device, dtype=logits.dtype), accumulate=True)


def _min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Drop tokens whose probability, at the row's temperature, is below min_p times the top one's.

    p_i / p_max = exp((l_i - l_max) / T), so the cut is l_max + T ln(min_p) on the raw logits.
    Greedy rows are left alone: their argmax never falls below the cut.
    """
    offsets = [p.temperature * math.log(p.min_p) if p.min_p > 0 and not p.greedy else float("-inf")
               for p in params]
    if all(o == float("-inf") for o in offsets):
        return logits
    cut = logits.max(dim=-1, keepdim=True).values + torch.tensor(offsets, device=logits.device)[:, None]
    return logits.masked_fill(logits < cut, float("-inf"))
