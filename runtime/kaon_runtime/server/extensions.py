"""vLLM's request extensions, from a parsed body to SamplingParams; and the unknown fields we ignore.

Unknown top-level fields are ignored, as vLLM does, so clients that send extensions of their
own still work. A typo must stay visible, though: each such name is logged once (not once per
request: a client sending it on every call would flood the log) and every response to a request
that carried any lists them in the x-kaon-ignored-fields header.
"""
from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel

IGNORED_FIELDS_HEADER = "x-kaon-ignored-fields"
MAX_LOGGED_NAMES = 1000  # a client inventing names on every call must not grow this set without end

log = logging.getLogger("kaon.server")
_logged: set[str] = set()


def ignored_fields(body: BaseModel) -> list[str]:
    """The unknown top-level fields of a request, logged once per name."""
    names = sorted(body.model_extra or {})
    for name in names:
        if name not in _logged and len(_logged) < MAX_LOGGED_NAMES:
            _logged.add(name)
            log.warning("ignoring the unknown request field %r (this server does not implement it)", name[:100])
    return names


def ignored_fields_header(body: BaseModel) -> dict[str, str]:
    names = ignored_fields(body)
    # Header values are latin-1 text: names outside it are left out of the header (still ignored).
    shown = [n for n in names if n.isascii() and n.isprintable() and "," not in n and len(n) <= 64][:50]
    return {IGNORED_FIELDS_HEADER: ",".join(shown)} if shown else {}


def sampling_extensions(body: Any) -> dict[str, Any]:
    """The SamplingParams fields of OpenAI's penalties and logit_bias and vLLM's extensions."""
    return {
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "logit_bias": {int(token): bias for token, bias in (body.logit_bias or {}).items()},
        "min_tokens": body.min_tokens, "min_p": body.min_p, "stop_token_ids": list(body.stop_token_ids or []),
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "prompt_logprobs": prompt_logprobs(body),
    }


def prompt_logprobs(body: Any) -> int | None:
    """How many alternatives to score per prompt token: vLLM's prompt_logprobs, or echo with
    logprobs (what evaluation harnesses send); None when the prompt is not scored."""
    wanted = [k for k in (getattr(body, "prompt_logprobs", None),
                          body.logprobs if getattr(body, "echo", False) else None) if k is not None]
    if wanted:
        return max(wanted)
    return 0 if getattr(body, "echo", False) and body.max_tokens == 0 else None
