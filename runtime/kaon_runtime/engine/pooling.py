"""Embeddings: a prompt's final hidden states pooled into one vector (`kaon serve --task embed`).

A request with `SamplingParams.pooling` is prefilled like any other, through the same scheduler
(batched with other requests, chunked when long) and ends with its prefill (max_tokens 0). The
runner keeps the final hidden rows (after the last norm, as transformers' last_hidden_state) of
each pooling sequence's chunk; here they are reduced on the sequence:

- "last": the hidden state of the prompt's last token. A decoder attends causally, so only the
  last position has seen the whole input; decoder embedding models (Qwen3-Embedding, e5-mistral,
  gte-Qwen2) are trained to put the embedding there, and it is vLLM's default for decoders.
- "mean": the average over every prompt position, for checkpoints whose sentence-transformers
  pooling config asks for it. Every position must be computed, so such a sequence takes nothing
  from the prefix cache (engine/block_manager.py), and a recompute after preemption starts over.

Normalization (and truncation to `dimensions`) is the server's (server/embeddings.py).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from kaon_runtime.engine.sequence import Sequence
from kaon_runtime.engine.step_plan import StepPlan

POOLING_METHODS = ("last", "mean")


def pooled_rows(plan: StepPlan, hidden: torch.Tensor) -> list[torch.Tensor]:
    """Per pool span of the plan: its chunk's hidden rows, in float32 (the sum is taken in float32)."""
    return [hidden[first:first + count].float() for _, first, count in plan.pool_spans]


def record_pooling(plan: StepPlan, seqs: list[Sequence], rows: list[torch.Tensor]) -> None:
    """Fold each pooling sequence's chunk into its running pool (`seqs`: the batch's, in its order).
    Called before the scheduler advances the sequences, so num_computed_tokens is the chunk's start."""
    for (i, _, count), chunk in zip(plan.pool_spans, rows):
        seq = seqs[i]
        if seq.params.pooling == "last":
            seq.pooled = chunk[-1]
        elif seq.num_computed_tokens == 0 or seq.pooled is None:  # a first chunk (or a recompute from the start)
            seq.pooled = chunk.sum(dim=0)
        else:
            seq.pooled = seq.pooled + chunk.sum(dim=0)
        if seq.num_computed_tokens + count >= seq.num_prompt_tokens:  # the prompt is in: the vector is done
            vector = seq.pooled / seq.num_prompt_tokens if seq.params.pooling == "mean" else seq.pooled
            seq.embedding, seq.pooled = vector.cpu().tolist(), None


def pooling_of_checkpoint(model: str) -> str:
    """The pooling a checkpoint directory's sentence-transformers config names ("mean" or "last");
    "last" when it names none (or is not a directory): the decoder convention above."""
    root = Path(model)
    try:
        modules = json.loads((root / "modules.json").read_text())
        folder = next(m["path"] for m in modules if m.get("type", "").endswith("Pooling"))
        config = json.loads((root / folder / "config.json").read_text())
    except (OSError, ValueError, StopIteration, KeyError, TypeError):
        return "last"
    return "mean" if config.get("pooling_mode_mean_tokens") else "last"


def matryoshka_of_checkpoint(model: str) -> bool | list[int]:
    """Whether a checkpoint directory's config.json says its embeddings may be cut short
    (Matryoshka training), under vLLM's names: `is_matryoshka` (any length), or the lengths
    `matryoshka_dimensions` lists. False when it says neither (or is not a directory)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    dimensions = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
    if isinstance(dimensions, list) and all(isinstance(d, int) for d in dimensions):
        return dimensions
    return isinstance(config, dict) and config.get("is_matryoshka") is True
