"""An embedding input's length against the model's maximum, as vLLM and OpenAI answer it. Pure.

An input longer than the model takes is refused (a 400 saying its token count and the maximum), never
embedded cut short without a word: the vector of a cut text is not the text's. A request that wants the
cut asks for it with vLLM's `truncate_prompt_tokens`: k keeps the input's first k tokens (vLLM's pooling
models truncate on the right, as sentence-transformers does), -1 the model's maximum; more than the
maximum is refused as vLLM refuses it. The sentence encoder (engine/encoder.py) and the decoder's pooled
requests (engine/llm_engine.py) both decide here.
"""
from __future__ import annotations

from kaon_runtime.errors import InvalidRequestError


def kept_tokens(truncate: int | None, limit: int) -> int | None:
    """How many tokens an input may keep when it is cut (None: not cut, refused past `limit`)."""
    if truncate is None:
        return None
    if truncate == -1:
        return limit
    if isinstance(truncate, bool) or not isinstance(truncate, int) or truncate < 1:
        raise InvalidRequestError(f"truncate_prompt_tokens must be an integer >= 1 or -1, got {truncate!r}")
    if truncate > limit:  # vLLM's words
        raise InvalidRequestError(f"truncate_prompt_tokens value ({truncate}) is greater than max_model_len "
                                  f"({limit}). Please, select a smaller truncation size.")
    return truncate


def check_length(num_tokens: int, limit: int) -> None:
    """Refuse an input of more than `limit` tokens, in vLLM's words (clients such as LiteLLM read them as
    a context-window error), with the way to ask for the cut."""
    if num_tokens > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested {num_tokens} tokens "
            "in the input for embedding generation. Please reduce the length of the input, or send "
            "truncate_prompt_tokens (-1: cut it to the maximum).", code="context_length_exceeded")
