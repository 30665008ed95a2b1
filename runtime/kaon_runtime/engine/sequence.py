"""A sequence: one prompt and the tokens generated for it, plus its place in the KV cache."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kaon_runtime.sampling import SamplingParams

if TYPE_CHECKING:
    from kaon_runtime.structured.matcher import SequenceGrammar


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    request_id: str = ""
    index: int = 0  # which of the request's n completions this is
    lora_id: int = 0  # the LoRA adapter it runs with (engine.lora_pool's id, never reused); 0: the base model
    status: SequenceStatus = SequenceStatus.WAITING
    # By when a prompt held back by the scheduler's prefill delay goes in anyway (its clock);
    # -inf: never held (a fork of a running request, a preempted sequence). Set when queued.
    prefill_due: float | None = None
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chain hashes of the leading full blocks
    num_computed_tokens: int = 0  # tokens whose K/V sit in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at (re)admission
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    logprobs: list[dict[int, float]] = field(default_factory=list)
    prompt_logprobs: dict[int, dict[int, float]] = field(default_factory=dict)  # by prompt position (1..)
    pooled: torch.Tensor | None = None  # an embedding request's pool so far (engine/pooling.py)
    embedding: list[float] | None = None  # and its vector, once the whole prompt is in
    # Speculative tokens proposed for this step: computed after token_ids, kept only if verified.
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), V]; None: a deterministic drafter
    # Where the generated tokens stand in the request's grammar (None: unconstrained). It follows
    # the tokens only, so preemption and prefix-cache hits leave it as it is.
    grammar: SequenceGrammar | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_decoding(self) -> bool:
        """Every token but the last is in the cache: the next step computes one token (plus drafts)."""
        return self.num_computed_tokens == self.num_tokens - 1

    def keep_drafts(self, n: int) -> None:
        del self.draft_token_ids[n:]
        if self.draft_probs is not None:
            self.draft_probs = self.draft_probs[:n] if n else None
