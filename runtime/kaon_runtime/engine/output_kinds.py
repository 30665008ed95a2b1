"""vLLM's RequestOutputKind for a streamed request: the engine's outputs are cumulative; DELTA hands the
consumer only what is new since the output it read before, FINAL_ONLY only the finished output."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.engine.stop_strings import held_back
from kaon_runtime.sampling import RequestOutputKind, SamplingParams


@dataclass(slots=True)
class Deltas:
    """What a DELTA consumer was given so far, per completion index: characters of text, tokens."""

    stops: tuple[str, ...]  # stop strings the engine will cut from the text: a tail that may become one waits
    sent_text: dict[int, int] = field(default_factory=dict)
    sent_tokens: dict[int, int] = field(default_factory=dict)
    started: bool = False

    def take(self, output: RequestOutput) -> RequestOutput:
        """`output` (cumulative) less what was handed out before; prompt logprobs come with the first only."""
        completions = [self._completion(c) for c in output.outputs]
        first, self.started = not self.started, True
        return replace(output, outputs=completions, prompt_logprobs=output.prompt_logprobs if first else None)

    def _completion(self, c: CompletionOutput) -> CompletionOutput:
        text_from, tokens_from = self.sent_text.get(c.index, 0), self.sent_tokens.get(c.index, 0)
        # What was handed out cannot be taken back, so a tail the engine may still cut as a stop string waits.
        safe = len(c.text) - (0 if c.finish_reason is not None else held_back(c.text, self.stops))
        safe = max(safe, text_from)
        self.sent_text[c.index], self.sent_tokens[c.index] = safe, len(c.token_ids)
        return replace(c, text=c.text[text_from:safe], token_ids=c.token_ids[tokens_from:],
                       logprobs=c.logprobs[tokens_from:] if c.logprobs is not None else None)


def deltas_for(params: SamplingParams) -> Deltas | None:
    """The DELTA state a stream of these params keeps; None for CUMULATIVE and FINAL_ONLY."""
    if params.output_kind is not RequestOutputKind.DELTA:
        return None
    return Deltas(() if params.include_stop_str_in_output else tuple(params.stop))
