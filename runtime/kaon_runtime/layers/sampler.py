"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, one host sync per step."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling settings, gathered from the sequences by the runner."""

    temperatures: list[float]
    top_ks: list[int]  # 0: off
    top_ps: list[float]  # 1.0: off
    generators: list[torch.Generator | None]  # a seeded generator, or None for the global RNG
    num_logprobs: int | None = None  # top alternatives to return (None: no logprobs at all)

    @property
    def all_greedy(self) -> bool:
        return all(t == 0 for t in self.temperatures)


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None  # per row: chosen token and top alternatives


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SampleResult:
    """logits [N, V] float32 -> one token per row."""
    greedy_tokens = logits.argmax(dim=-1)
    if batch.all_greedy:
        tokens = greedy_tokens
    else:
        tokens = torch.where(_is_greedy(batch, logits.device), greedy_tokens, _sample_random(logits, batch))
    logprobs = logprobs_of(logits, tokens, batch.num_logprobs) if batch.num_logprobs is not None else None
    return SampleResult(tokens.tolist(), logprobs)


def _is_greedy(batch: SamplingBatch, device) -> torch.Tensor:
    return torch.tensor([t == 0 for t in batch.temperatures], device=device)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    return draw(sampling_probs(logits, batch.temperatures, batch.top_ks, batch.top_ps), batch.generators)


def sampling_probs(logits: torch.Tensor, temperatures: list[float], top_ks: list[int],
                   top_ps: list[float]) -> torch.Tensor:
    """The distribution each row samples from: temperature, then top-k/top-p, then softmax.

    Rows with temperature 0 come out as plain softmax; callers treat them as greedy.
    """
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
    logits = logits / temps[:, None]
    if any(k > 0 for k in top_ks) or any(p < 1.0 for p in top_ps):
        logits = _apply_top_k_top_p(logits, top_ks, top_ps)
    return torch.softmax(logits, dim=-1)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row of probs [N, V]."""
    # Exponential race: argmax(p / E) with E ~ Exp(1) draws from p, and lets each row
    # take its noise from its own seeded generator while the math stays batched.
    noise = torch.empty_like(probs)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
    for i, generator in enumerate(generators):
        if generator is not None:
            noise[i].exponential_(generator=generator)
    return (probs / noise).argmax(dim=-1)


def _apply_top_k_top_p(logits: torch.Tensor, top_ks: list[int], top_ps: list[float]) -> torch.Tensor:
    vocab = logits.shape[1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_ks], device=logits.device)
    ps = torch.tensor(top_ps, device=logits.device, dtype=logits.dtype)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= ks[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    # Keep the smallest head whose mass reaches top_p: drop a token once the mass before it does.
    drop |= (probs.cumsum(dim=-1) - probs) >= ps[:, None]
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[dict[int, float]]:
    logp = torch.log_softmax(logits, dim=-1)
    chosen = logp.gather(1, tokens[:, None])
    if k > 0:
        top_vals, top_ids = logp.topk(k, dim=-1)
        ids = torch.cat([tokens[:, None], top_ids], dim=1).tolist()
        vals = torch.cat([chosen, top_vals], dim=1).tolist()
    else:
        ids, vals = tokens[:, None].tolist(), chosen.tolist()
    return [dict(zip(row_ids, row_vals)) for row_ids, row_vals in zip(ids, vals)]
