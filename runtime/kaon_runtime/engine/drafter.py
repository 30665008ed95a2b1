"""Speculative drafting: guess a sequence's next few tokens cheaply for the target to verify.

Every drafter answers the same question — up to k next tokens per decoding sequence, and
the distribution each was drawn from (None when the guess is deterministic) — so the
engine, the scheduler and the verifier do not care where the guesses come from.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from kaon_runtime.engine.sequence import Sequence


@dataclass(slots=True)
class Draft:
    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V]; None: each token was certain


class Drafter(Protocol):
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        """At most limits[i] tokens to follow seqs[i].token_ids, for each decoding sequence."""

    def forget(self, seq: Sequence) -> None:
        """The sequence is finished: drop whatever the drafter keeps for it."""


def draft_limit(seq: Sequence, k: int, max_model_len: int) -> int:
    """How many drafts a sequence may take: verifying k drafts can emit k + 1 tokens, and
    those must fit both max_tokens and the context."""
    room = max_model_len - seq.num_tokens
    if seq.params.max_tokens is not None:
        room = min(room, seq.params.max_tokens - seq.num_output_tokens)
    return max(0, min(k, room - 1))


def prompt_lookup(token_ids: list[int], k: int, max_ngram: int, min_ngram: int = 1) -> list[int]:
    """Prompt-lookup drafting: find the latest earlier occurrence of the sequence's last n
    tokens (longest n first) and propose the up to k tokens that followed it.

    Repetitive text (code being edited, quoted documents, lists) continues the way it went
    before, so the guesses are often right and cost no model at all.
    """
    length = len(token_ids)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = token_ids[length - n:]
        last = suffix[-1]
        # Scan right to left: the latest match is the likeliest to continue the same way.
        for end in range(length - 2, n - 2, -1):
            if token_ids[end] == last and token_ids[end - n + 1:end + 1] == suffix:
                return token_ids[end + 1:end + 1 + k]
    return []


class NgramDrafter:
    """Drafts from the sequence's own prompt and output; no second model."""

    def __init__(self, max_ngram: int, min_ngram: int):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[Draft]:
        return [Draft(prompt_lookup(seq.token_ids, k, self.max_ngram, self.min_ngram) if k else [])
                for seq, k in zip(seqs, limits)]

    def forget(self, seq: Sequence) -> None:
        pass
