"""Per-request sampling parameters, validated on creation."""
from __future__ import annotations

from dataclasses import dataclass, field

from kaon_runtime.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures this small are treated as 0
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    n: int = 1
    # Structured output, as vLLM names it; at most one. The engine compiles it once (cached by
    # value) and masks each step's logits to the tokens it allows (kaon_runtime.structured).
    json_schema: dict | str | None = None  # a JSON Schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF, in xgrammar's dialect (GBNF-like)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    structural_tag: dict | None = None  # xgrammar's structural tag: how the server forces tool calls

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # dividing logits by less underflows the softmax; it is greedy anyway
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and 0 <= self.top_k < 2 ** 63,
               f"top_k must be in [0, 2^63), got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and -2 ** 63 <= self.seed < 2 ** 63),
               f"seed must be a 64-bit integer, got {self.seed!r}")
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
               f"max_tokens must be >= 1, got {self.max_tokens!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be in [0, 20], got {self.logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        constraints = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(len(constraints) <= 1, f"at most one of {', '.join(CONSTRAINTS)} may be set, got {constraints}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def constrained(self) -> bool:
        """Whether a grammar constrains the output."""
        return any(getattr(self, name) not in (None, False) for name in CONSTRAINTS)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequestError(message)
