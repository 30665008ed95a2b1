"""What the engine hands back for a request after each step."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort"
    logprobs: list[dict[int, float]] | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None  # per prompt token, None first
    embedding: list[float] | None = None  # an embedding request's pooled vector, not normalized

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)
