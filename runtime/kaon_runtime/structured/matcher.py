"""One sequence's place in its grammar: the next token's mask, advanced by each token, rolled back.

A `SequenceGrammar` follows the sequence's generated tokens only (never the prompt), so it does
not care how the sequence's K/V got into the cache: a preempted sequence recomputed later, or
one admitted on a prefix-cache hit, keeps its grammar state as it was. Speculative drafts are
walked forward to build their rows' masks, then rolled back before the verified tokens are
accepted (`masks_for_drafts`).
"""
from __future__ import annotations

import torch
import xgrammar as xgr


class SequenceGrammar:
    """The matcher of one sequence (xgrammar's GrammarMatcher; it can roll back any number of tokens)."""

    __slots__ = ("_matcher",)

    def __init__(self, compiled: xgr.CompiledGrammar):
        self._matcher = xgr.GrammarMatcher(compiled)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and its stop token accepted: nothing more may follow."""
        return self._matcher.is_terminated()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit i of word w: token 32w + i)."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one token; False (and no change) when the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    def advance(self, token_id: int) -> bool:
        """Take a generated token; True when the output must end there: the grammar is complete
        (its stop token taken), or it refused the token (only an unmasked step could produce one)."""
        return not self.accept(token_id) or self.is_terminated

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def masks_for_drafts(self, drafts: list[int], bitmask: torch.Tensor, first_row: int) -> None:
        """The masks of a speculative step's k + 1 rows: after the real tokens, then after each draft.

        The matcher walks the drafts and comes back, so its state is unchanged. A draft the grammar
        refuses is masked out in its own row, so verification rejects it; the rows after it are
        never used, and are left allowing everything.
        """
        walked = 0
        for i, token in enumerate(drafts):
            self.fill(bitmask, first_row + i)
            if not self.accept(token):
                bitmask[first_row + i + 1:first_row + len(drafts) + 1] = -1
                break
            walked += 1
            if self.is_terminated:  # a draft was the stop token: the sequence ends with it
                bitmask[first_row + i + 1:first_row + len(drafts) + 1] = -1
                break
        else:
            self.fill(bitmask, first_row + len(drafts))
        self.rollback(walked)
