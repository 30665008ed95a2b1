"""A completion's prompt in its response: echo (OpenAI's legacy logprobs format) and vLLM's prompt_logprobs.

Evaluation harnesses score a continuation by sending context + continuation with echo, logprobs
and max_tokens 0, then summing the continuation's token_logprobs; the first token has nothing
before it, so its logprob is null, as OpenAI sends it.
"""
from __future__ import annotations

from collections.abc import Callable

from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.server import protocol as p


def prompt_text(output: RequestOutput, tokenizer: Tokenizer) -> str:
    return output.prompt if output.prompt is not None else tokenizer.decode(output.prompt_token_ids)


def echoed_logprobs(output: RequestOutput, name: Callable[[int], str], k: int) -> p.CompletionLogprobs:
    """The prompt's tokens in the legacy format: token, its logprob (None first), the top k, text offset."""
    out = p.CompletionLogprobs()
    scored = output.prompt_logprobs or [None] * len(output.prompt_token_ids)
    offset = 0
    for token_id, entry in zip(output.prompt_token_ids, scored):
        token = name(token_id)
        out.tokens.append(token)
        out.text_offset.append(offset)
        offset += len(token)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry[token_id])
        best = sorted(entry.items(), key=lambda item: -item[1])[:k]
        out.top_logprobs.append(legacy_top([(name(t), lp) for t, lp in best], token, entry[token_id]))
    return out


def legacy_top(best: list[tuple[str, float]], token: str, logprob: float) -> dict[str, float]:
    """A legacy top_logprobs entry: the k most likely and the token itself, "up to logprobs+1 elements"
    as OpenAI documents it and vLLM sends it; harnesses look the token up there (logprobs 0 is the token alone)."""
    top = dict(best)
    top.setdefault(token, logprob)
    return top


def vllm_prompt_logprobs(output: RequestOutput, name: Callable[[int], str],
                         k: int) -> list[dict[str, p.PromptLogprob] | None] | None:
    """vLLM's shape: per prompt token, the token itself and the top k, keyed by token id."""
    if output.prompt_logprobs is None:
        return None
    result: list[dict[str, p.PromptLogprob] | None] = []
    for token_id, entry in zip(output.prompt_token_ids, output.prompt_logprobs):
        if entry is None:
            result.append(None)
            continue
        best = [t for t, _ in sorted(entry.items(), key=lambda item: -item[1])[:k]]
        result.append({str(t): p.PromptLogprob(logprob=entry[t], decoded_token=name(t))
                       for t in [token_id, *best]})
    return result
