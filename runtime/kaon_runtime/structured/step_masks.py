"""One step's token masks, computed on a worker thread while the forward pass runs.

The runner knows the step's sample rows (a sequence with k drafts has k + 1) before it runs the
model; the masks depend only on the grammars' states, not on the logits, so they are filled on
a worker thread meanwhile and joined before sampling. A step without grammars starts no work
and pays nothing.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kaon_runtime.structured.masks import allocate_bitmask

if TYPE_CHECKING:
    from kaon_runtime.structured.matcher import SequenceGrammar


@dataclass(slots=True)
class StepMasks:
    bitmask: torch.Tensor  # [sample rows, ceil(V / 32)] int32
    rows: list[int]  # the rows that have a grammar (the others are all ones, and not applied)


def fill_step_masks(rows: list[tuple[SequenceGrammar | None, list[int]]], vocab_size: int) -> StepMasks | None:
    """The masks of a step whose sequences, in row order, have these (grammar, drafts); None without grammars."""
    if all(grammar is None for grammar, _ in rows):
        return None
    bitmask = allocate_bitmask(sum(len(drafts) + 1 for _, drafts in rows), vocab_size)
    masked: list[int] = []
    first = 0
    for grammar, drafts in rows:
        if grammar is not None:
            if drafts:
                grammar.masks_for_drafts(drafts, bitmask, first)
            else:
                grammar.fill(bitmask, first)
            masked.extend(range(first, first + len(drafts) + 1))
        first += len(drafts) + 1
    return StepMasks(bitmask, masked)


class MaskWorker:
    """A thread that fills a step's masks while the caller runs the model."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kaon-grammar")

    def start(self, rows: list[tuple[SequenceGrammar | None, list[int]]]) -> Future | None:
        """Begin filling the masks (see fill_step_masks); None, and no work, when no row has a grammar.

        The drafts are copied: the caller may trim its lists while the worker reads them.
        """
        if all(grammar is None for grammar, _ in rows):
            return None
        return self._pool.submit(fill_step_masks, [(g, list(d)) for g, d in rows], self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
