"""One step's tokens for every sequence that reached its end: plain rows sampled in one batch,
drafted ones verified against the target's rows (layers.rejection)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kaon_runtime.layers.penalties import RowHistory, adjust_logits, needs_adjusting
from kaon_runtime.layers.rejection import verify
from kaon_runtime.layers.sampler import SamplingBatch, logprobs_of, sample
from kaon_runtime.sampling import SamplingParams

_NO_HISTORY = RowHistory(SamplingParams(max_tokens=None), [])  # a row nothing adjusts


@dataclass(slots=True)
class RowsToSample:
    """One sequence's share of the step's logits: 1 + len(draft_token_ids) consecutive rows."""

    params: SamplingParams
    generator: torch.Generator | None  # its seeded generator; None draws from the global RNG
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [k, V]; None: a deterministic drafter
    history: RowHistory | None = None  # for penalties, logit_bias, min_p, min_tokens; None: none asked


@dataclass(slots=True)
class SampledTokens:
    """Per sequence: the tokens it gains (kept drafts, then one sampled) and, if asked, their logprobs."""

    token_ids: list[list[int]]
    logprobs: list[list[dict[int, float]]] | None  # per sequence, one dict per gained token


def seeded_generator(seed: int, index: int, device: torch.device) -> torch.Generator:
    """A request's generator for completion `index`: the index is mixed in, so that seed s,
    choice 1 differs from seed s + 1, choice 0."""
    generator = torch.Generator(device=device)
    generator.manual_seed(hash((seed, index)) & (2 ** 63 - 1))
    return generator


def is_plain(params: SamplingParams) -> bool:
    """Whether a row of this request is sampled from its logits as they are, by the batch: no logprobs,
    no seed (the global RNG), nothing that adjusts logits (penalties, logit_bias, min_p, min_tokens)."""
    return params.logprobs is None and params.seed is None and not needs_adjusting(params)


def sample_plain(logits: torch.Tensor, params: list[SamplingParams]) -> list[int]:
    """One token per row of logits [N, V], every row plain (`is_plain`) and without drafts: the common step,
    sampled with no per-row objects. The same calls as sample_rows makes for such rows (the same tokens,
    the same draws from the global RNG): argmax alone when every row is greedy, else `sample`."""
    if all(p.temperature == 0 for p in params):
        return logits.argmax(dim=-1).tolist()
    batch = SamplingBatch(temperatures=[p.temperature for p in params], top_ks=[p.top_k for p in params],
                          top_ps=[p.top_p for p in params], generators=[None] * len(params))
    return sample(logits, batch).token_ids


def sample_rows(logits: torch.Tensor, rows: list[RowsToSample]) -> SampledTokens:
    """logits [sum of each sequence's rows, V], in the order of `rows`."""
    if any(r.history is not None for r in rows):
        logits = adjust_logits(logits, _row_histories(rows))
    wanted = [r.params.logprobs for r in rows if r.params.logprobs is not None]
    num_logprobs = max(wanted) if wanted else None
    tokens: list[list[int]] = [[] for _ in rows]
    logprobs: list[list[dict[int, float]]] | None = [[] for _ in rows] if num_logprobs is not None else None
    plain, plain_rows, at = [], [], 0
    for i, r in enumerate(rows):
        k = len(r.draft_token_ids)
        if k == 0:
            plain.append(i)
            plain_rows.append(at)
        else:
            own = logits[at:at + k + 1]
            tokens[i] = verify(own, r.draft_token_ids, r.draft_probs, r.params, r.generator)
            if logprobs is not None and num_logprobs is not None:
                emitted = torch.tensor(tokens[i], device=logits.device)
                logprobs[i] = logprobs_of(own[:len(emitted)], emitted, num_logprobs)
        at += k + 1
    if plain:
        result = sample(logits[plain_rows], _sampling_batch([rows[i] for i in plain], num_logprobs))
        for j, i in enumerate(plain):
            tokens[i] = [result.token_ids[j]]
            if logprobs is not None and result.logprobs is not None:
                logprobs[i] = [result.logprobs[j]]
    return SampledTokens(tokens, logprobs)


def _sampling_batch(rows: list[RowsToSample], num_logprobs: int | None) -> SamplingBatch:
    return SamplingBatch(
        temperatures=[r.params.temperature for r in rows],
        top_ks=[r.params.top_k for r in rows],
        top_ps=[r.params.top_p for r in rows],
        generators=[r.generator for r in rows],
        num_logprobs=num_logprobs,
    )


def _row_histories(rows: list[RowsToSample]) -> list[RowHistory]:
    """One history per logits row: a draft's row has seen the drafts before it as output."""
    out = []
    for r in rows:
        h = r.history
        if h is None:
            out.extend([_NO_HISTORY] * (1 + len(r.draft_token_ids)))
            continue
        out.append(h)
        for j in range(1, len(r.draft_token_ids) + 1):
            seen = h.output_token_ids + r.draft_token_ids[:j]
            banned = h.banned_token_ids if len(seen) < h.params.min_tokens else []
            out.append(RowHistory(h.params, seen, h.prompt_token_ids, banned))
    return out
