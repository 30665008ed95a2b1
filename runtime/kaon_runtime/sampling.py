"""Per-request sampling parameters, validated on creation."""
from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from kaon_runtime.errors import InvalidRequestError

GREEDY_BELOW = 1e-5  # temperatures this small are treated as 0
CONSTRAINTS = ("json_schema", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's StructuredOutputsParams' names -> ours
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                      "json_object": "json_object"}


class RequestOutputKind(enum.IntEnum):
    """vLLM's (vllm.sampling_params): what each output of a streamed request (AsyncEngine's stream) carries.
    LLM.generate returns each request's finished output whole whatever the kind, as vLLM's LLM does."""

    CUMULATIVE = 0  # all of the text and tokens so far
    DELTA = 1  # only the text and tokens new since the output before
    FINAL_ONLY = 2  # one output: the finished one


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens. temperature 0 means greedy."""

    temperature: float = 1.0
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's context length; 0 (with prompt_logprobs): none
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives to return per token
    n: int = 1
    # vLLM's extensions (layers/penalties.py applies them to the logits, batched).
    presence_penalty: float = 0.0  # subtracted once from every token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt or the output (CTRL's rule)
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit, within ±100
    min_tokens: int = 0  # EOS, stop_token_ids and stop strings do not end the output before this many tokens
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top alternatives per prompt token (None: no prompt logprobs)
    pooling: str | None = None  # "last" or "mean": embed the prompt (with max_tokens 0; engine/pooling.py)
    # Structured output, as vLLM names it; at most one. The engine compiles it once (cached by
    # value) and masks each step's logits to the tokens it allows (kaon_runtime.structured).
    json_schema: dict | str | None = None  # a JSON Schema (or its text)
    regex: str | None = None
    choice: list[str] | None = None  # the output is exactly one of these strings
    grammar: str | None = None  # EBNF, in xgrammar's dialect (GBNF-like)
    json_object: bool = False  # any JSON object (OpenAI's response_format json_object)
    structural_tag: dict | None = None  # xgrammar's structural tag: how the server forces tool calls
    # vLLM's cache_salt: requests with different salts share no prefix-cache blocks, so one tenant
    # cannot tell by timing whether another's prompt is cached (the server salts per API key).
    cache_salt: str | None = None
    # vLLM's SamplingParams(structured_outputs=StructuredOutputsParams(json=...)), or a dict of the same
    # (json, regex, choice, grammar, json_object): turned into the fields above on creation, then None.
    structured_outputs: object | None = None
    # vLLM's: only these token ids may be sampled (None: any); bad_words: words never generated (each
    # as the tokenizer splits it, with and without a leading space; a multi-token word's last token is
    # banned where the output ends with the rest of it); truncate_prompt_tokens: keep only the prompt's
    # last k tokens (-1: as many as the context holds). layers/penalties.py and LLMEngine.validate.
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # vLLM's: detokenize=False leaves every output's text empty (token ids only; no stop strings then);
    # output_kind: RequestOutputKind, above. logits_processors: vLLM's V0 per-request callables, refused
    # when given (as vLLM's V1 engine does): the batched sampler and the fused CPU step never call back.
    detokenize: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logits_processors: list[Callable] | None = None
    # bad_words as token ids, filled by LLMEngine.validate from the model's tokenizer (not vLLM's name).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.structured_outputs is not None:
            self._take_structured_outputs()
        _check(isinstance(self.temperature, (int, float)) and self.temperature >= 0,
               f"temperature must be >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0  # dividing logits by less underflows the softmax; it is greedy anyway
        _check(isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
               f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k < 2 ** 63,
               f"top_k must be in [0, 2^63) (or -1), got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0  # vLLM's older "off", still sent by its clients: 0 here
        _check(self.seed is None or (isinstance(self.seed, int) and -2 ** 63 <= self.seed < 2 ** 63),
               f"seed must be a 64-bit integer, got {self.seed!r}")
        # 0 only to score a prompt (prompt_logprobs), as evaluation harnesses do.
        least = 0 if self.prompt_logprobs is not None or self.pooling is not None else 1
        _check(self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= least),
               f"max_tokens must be >= {least}, got {self.max_tokens!r}")
        _check(isinstance(self.n, int) and self.n >= 1, f"n must be >= 1, got {self.n!r}")
        _check(self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20),
               f"logprobs must be in [0, 20], got {self.logprobs!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids must be non-negative integers")
        _check(all(isinstance(v, (int, float)) and -2 <= v <= 2 for v in (self.presence_penalty,
                                                                          self.frequency_penalty)),
               "presence_penalty and frequency_penalty must be in [-2, 2]")
        _check(isinstance(self.repetition_penalty, (int, float)) and 0 < self.repetition_penalty <= 2 ** 16,
               f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        _check(isinstance(self.logit_bias, dict) and all(
            isinstance(t, int) and t >= 0 and isinstance(v, (int, float)) and -100 <= v <= 100
            for t, v in self.logit_bias.items()), "logit_bias maps token ids to values in [-100, 100]")
        _check(isinstance(self.min_tokens, int) and self.min_tokens >= 0
               and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
               f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        _check(isinstance(self.min_p, (int, float)) and 0 <= self.min_p <= 1,
               f"min_p must be in [0, 1], got {self.min_p!r}")
        _check(self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                                and 0 <= self.prompt_logprobs <= 20),
               f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs!r}")
        _check(self.pooling in (None, "last", "mean"), f"pooling must be 'last' or 'mean', got {self.pooling!r}")
        _check(self.allowed_token_ids is None or (isinstance(self.allowed_token_ids, (list, tuple)) and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)),
               "allowed_token_ids must be a list of token ids")
        _check(self.allowed_token_ids is None or len(self.allowed_token_ids) > 0,
               "allowed_token_ids is not None and empty!")  # vLLM's words
        _check(self.bad_words is None or (isinstance(self.bad_words, (list, tuple)) and all(
            isinstance(w, str) for w in self.bad_words)), "bad_words must be a list of strings")
        _check(self.truncate_prompt_tokens is None or (
            isinstance(self.truncate_prompt_tokens, int) and not isinstance(self.truncate_prompt_tokens, bool)
            and (self.truncate_prompt_tokens >= 1 or self.truncate_prompt_tokens == -1)),
               f"truncate_prompt_tokens must be an integer >= 1 or -1, got {self.truncate_prompt_tokens!r}")
        self._check_vllm_output_fields()
        constraints = [name for name in CONSTRAINTS if getattr(self, name) not in (None, False)]
        _check(len(constraints) <= 1, f"at most one of {', '.join(CONSTRAINTS)} may be set, got {constraints}")

    def _check_vllm_output_fields(self) -> None:
        _check(isinstance(self.detokenize, bool), f"detokenize must be True or False, got {self.detokenize!r}")
        _check(self.detokenize or not self.stop, "stop strings are only supported when detokenize is True "
                                                 "(vLLM's rule): set detokenize=True to use stop")
        _check(isinstance(self.output_kind, int) and not isinstance(self.output_kind, bool)
               and self.output_kind in tuple(RequestOutputKind),
               f"output_kind must be a RequestOutputKind (CUMULATIVE, DELTA, FINAL_ONLY), got {self.output_kind!r}")
        self.output_kind = RequestOutputKind(self.output_kind)
        _check(not self.logits_processors,
               "logits_processors (per-request callables) are not supported: kaon's sampler runs batched, without "
               "calling back into Python (vLLM's V1 engine refuses them too); use logit_bias, allowed_token_ids, "
               "bad_words or structured output instead")

    def _take_structured_outputs(self) -> None:
        given, self.structured_outputs = self.structured_outputs, None
        def read(name: str):
            return given.get(name) if isinstance(given, dict) else getattr(given, name, None)
        unknown = set(given) - set(STRUCTURED_OUTPUTS) if isinstance(given, dict) else set()
        _check(not unknown, f"structured_outputs: unknown keys {sorted(unknown)}; it takes "
                            f"{', '.join(STRUCTURED_OUTPUTS)}")
        for theirs, ours in STRUCTURED_OUTPUTS.items():
            value = read(theirs)
            if value not in (None, False):
                _check(getattr(self, ours) in (None, False),
                       f"structured_outputs.{theirs} and {ours} are both set")
                setattr(self, ours, value)

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
