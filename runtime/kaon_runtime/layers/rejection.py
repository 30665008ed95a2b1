"""Speculative verification: keep the drafted tokens the target model agrees with, exactly.

Rejection sampling after Leviathan et al. and Chen et al.: draft token x, proposed with
probability q(x), is kept with probability min(1, p(x) / q(x)), p being the target's
distribution at that position. At the first rejection the replacement is drawn from
normalize(max(0, p - q)); if every draft is kept, one more token comes from the target's
distribution after the last one. Each emitted token is then distributed exactly as if the
target had sampled it alone. A deterministic drafter (prompt lookup) has q one-hot at its
token, so the keep probability is p(x). Greedy requests have p one-hot at the argmax: a
draft is kept while it equals the target's argmax, and the replacement is the argmax.
"""
from __future__ import annotations

import torch

from kaon_runtime.layers.sampler import draw, sampling_probs
from kaon_runtime.sampling import SamplingParams


def verify(logits: torch.Tensor, draft: list[int], draft_probs: torch.Tensor | None, params: SamplingParams,
           generator: torch.Generator | None) -> list[int]:
    """logits [k + 1, V]: the target's at the last real token and at each of the k drafts.

    draft_probs [k, V] is the distribution each draft was drawn from (None: one-hot, a
    deterministic drafter). Returns the kept drafts followed by one token of the target's.
    """
    k = len(draft)
    assert logits.shape[0] == k + 1, f"{logits.shape[0]} rows of logits for {k} drafts"
    if params.greedy:
        best = logits.argmax(dim=-1).tolist()
        kept = _leading_true([d == b for d, b in zip(draft, best)])
        return draft[:kept] + [best[kept]]
    rows = k + 1
    p = sampling_probs(logits, [params.temperature] * rows, [params.top_k] * rows, [params.top_p] * rows)
    ids = torch.tensor(draft, device=logits.device)
    at = torch.arange(k, device=logits.device)
    p_draft = p[at, ids]
    q_draft = torch.ones_like(p_draft) if draft_probs is None else draft_probs[at, ids].to(p.dtype)
    u = torch.rand(k, generator=generator, device=logits.device, dtype=p.dtype)
    kept = _leading_true((u * q_draft < p_draft).tolist())  # u < p / q without dividing by a zero q
    if kept == k:
        return draft + [_draw_one(p[k], generator)]
    return draft[:kept] + [_draw_one(residual(p[kept], draft[kept], None if draft_probs is None
                                              else draft_probs[kept].to(p.dtype)), generator)]


def residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, p - q)) for the rejected `token`; q None means one-hot at it."""
    if q is None:
        out = p.clone()
        out[token] = 0
    else:
        out = (p - q).clamp_min(0)
    total = out.sum()
    # A rejection implies p(token) < q(token), hence mass elsewhere; only rounding can leave none.
    return out / total if total > 0 else p


def _draw_one(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(draw(probs[None, :], [generator])[0])


def _leading_true(flags: list[bool]) -> int:
    n = 0
    while n < len(flags) and flags[n]:
        n += 1
    return n
