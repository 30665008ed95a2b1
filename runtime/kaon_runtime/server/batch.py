"""A batch of prompts in one /v1/completions request (OpenAI's and vLLM's `prompt` as a list of strings
or of token id lists): one engine request per prompt, answered as one response.

As in OpenAI and vLLM, prompt i's n choices are choices i*n .. i*n+n-1, and the usage is the batch's
sum. Each prompt runs through the same CompletionFormat as a prompt alone (echo, logprobs, scoring);
what is here is only the merge: of the finished responses, and of the streams' chunks as they come (a
stream's head is sent once the first prompt has a token, not the last: GenerationBatch.start).
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

from kaon_runtime.errors import KaonError
from kaon_runtime.server import protocol as p
from kaon_runtime.server.serving import (
    CompletionFormat,
    Generation,
    _settle,
    _unless_gone,
    error_event,
    event,
    stream_chunks,
    usage,
)

MAX_PROMPTS = 1024  # prompts in one request; each is also a place in the engine's queue (--max-queue)


def prompts_of(prompt: str | list) -> list[str | list[int]]:
    """The request's prompts: one (a string or token ids; an empty one is refused downstream) or a batch."""
    if isinstance(prompt, str) or not prompt or isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


class GenerationBatch:
    """The generations of one batched request, closed together however the response ends."""

    def __init__(self, gens: Sequence[Generation] = ()):
        self.gens = list(gens)
        self.starts: list[asyncio.Task[bool]] = []  # each prompt's wait for its first output (start)

    async def start(self, disconnected: Callable[[], Awaitable[object]]) -> bool:
        """Wait until the first of the prompts has its first output (a stream's head waits for no more, as OpenAI
        and vLLM stream each choice as it comes; the others' first outputs are awaited by batch_sse_events);
        raise its error (a refusal answered by its status); False if the client went away first."""
        self.starts = [asyncio.ensure_future(gen.start(_never)) for gen in self.gens]  # one disconnect watch, below
        first = await _unless_gone(asyncio.wait(self.starts, return_when=asyncio.FIRST_COMPLETED), disconnected)
        if first is None:
            return False
        for task in first.result()[0]:
            task.result()
        return True

    def close(self) -> None:
        _settle(*self.starts)
        for gen in self.gens:
            gen.close()


async def _never() -> None:
    """A disconnect watch that never fires: a prompt's start under GenerationBatch.start, which watches once."""
    await asyncio.Event().wait()


def summed_usage(infos: Sequence[p.UsageInfo]) -> p.UsageInfo:
    prompt = sum(u.prompt_tokens for u in infos)
    completion = sum(u.completion_tokens for u in infos)
    cached = sum(u.prompt_tokens_details.cached_tokens for u in infos if u.prompt_tokens_details is not None)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=cached))


def merged_response(responses: Sequence[p.CompletionResponse], n: int) -> p.CompletionResponse:
    """One response of the prompts' own: the first's id, prompt i's choices at i*n + their index."""
    choices = [c.model_copy(update={"index": i * n + c.index}) for i, r in enumerate(responses) for c in r.choices]
    return responses[0].model_copy(update={
        "choices": choices, "usage": summed_usage([r.usage for r in responses if r.usage is not None])})


async def batch_sse_events(batch: GenerationBatch, fmts: Sequence[CompletionFormat], n: int, include_usage: bool,
                           continuous_usage: bool = False) -> AsyncIterator[str]:
    """The prompts' chunks interleaved as each comes, under the first prompt's id with prompt i's choices
    renumbered from i*n; then the summed usage (if asked for) and [DONE]."""
    queue: asyncio.Queue[tuple[int, p.CompletionResponse | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            if batch.starts:  # this prompt's first output, if it has not come yet
                await batch.starts[i]
            async for chunk in stream_chunks(batch.gens[i], fmts[i], n, continuous_usage):
                queue.put_nowait((i, chunk))  # type: ignore[arg-type]  # completions' chunks are responses
            queue.put_nowait((i, None))
        except Exception as exc:  # noqa: BLE001  handed to the consumer, which raises or reports it
            queue.put_nowait((i, exc))

    head = batch.gens[0].request_id
    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(batch.gens))]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, KaonError):  # the engine died under us: said in-band, as for one prompt
                yield error_event(item)
                return
            elif isinstance(item, BaseException):
                raise item
            else:
                chunk = item.model_copy(update={"id": head, "choices": [
                    c.model_copy(update={"index": i * n + c.index}) for c in item.choices]})
                yield event(chunk, include_usage)
    finally:
        for task in tasks:
            task.cancel()
    if include_usage:
        finals = [usage(gen.last) for gen in batch.gens if gen.last is not None]
        yield event(fmts[0].usage_chunk(summed_usage(finals)), include_usage)
    yield "data: [DONE]\n\n"
