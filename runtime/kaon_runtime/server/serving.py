"""From engine outputs to OpenAI responses: whole responses, and SSE streams of chunks.

Engine outputs are cumulative (the text so far), so a stream sends the difference from what
it sent before. Completions and chat differ only in how a choice is wrapped; `_Format`
subclasses hold that difference and the rest is shared.

Over 300 lines for a stated reason: the whole-response and streaming paths, batched prompts and echo
included, run through the same `_Format` methods and the same waits on a client that went away; split,
each half would reach into the other's helpers.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from pydantic import BaseModel

from kaon_runtime.engine.async_engine import RequestStream
from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.engine.stop_strings import held_back
from kaon_runtime.errors import KaonError
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.server import protocol as p
from kaon_runtime.server.echo import echoed_logprobs, legacy_top, prompt_text, vllm_prompt_logprobs
from kaon_runtime.server.metrics import RequestTimer
from kaon_runtime.server.tool_calls import ToolCalling, ToolCallStream, assistant_message

_T = TypeVar("_T")


@dataclass(eq=False)
class Generation:
    """One accepted request, from the engine stream to the last byte sent."""

    request_id: str
    model: str
    stream: RequestStream
    timer: RequestTimer
    stops: list[str]
    num_logprobs: int | None  # None: the client asked for no logprobs
    created: int = field(default_factory=lambda: int(time.time()))
    last: RequestOutput | None = None
    _closed: bool = False
    _head: RequestOutput | None = None  # the first output, taken by `start`, not yet yielded

    async def start(self, disconnected: Callable[[], Awaitable[object]]) -> bool:
        """Wait for the request's first output (its first token) before a stream's response head is sent, so
        a request refused while it waited (past capacity: engine.admission) is answered by its status, a 503
        with Retry-After, not by a 200 stream carrying an error. Raises the stream's error; False if the
        client went away first."""
        first = await _unless_gone(anext(self.stream), disconnected)
        if first is None:
            return False
        self._head = first.result()
        self.timer.observe(self._head)
        self.last = self._head
        return True

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        if self._head is not None:
            head, self._head = self._head, None
            yield head
            if head.finished:
                return
        async for output in self.stream:
            self.timer.observe(output)
            self.last = output
            yield output

    def close(self) -> None:
        """Abort the request if it is still running, record it; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self.stream.abort()
        finished = self.last is not None and self.last.finished
        self.timer.finish(self.last, aborted=not finished)


def usage(output: RequestOutput) -> p.UsageInfo:
    completion = sum(len(c.token_ids) for c in output.outputs)
    prompt = len(output.prompt_token_ids)
    return p.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                       prompt_tokens_details=p.PromptTokensDetails(cached_tokens=output.num_cached_tokens))


async def final_output(gen: Generation, disconnected: Callable[[], Awaitable[object]]) -> RequestOutput | None:
    """Run a request to its end; None if the client went away first."""
    async def last() -> RequestOutput | None:
        async for _ in gen.outputs():
            pass
        return gen.last

    run = await _unless_gone(last(), disconnected)
    return None if run is None else run.result()


async def final_outputs(gens: Sequence[Generation], disconnected: Callable[[], Awaitable[object]]
                        ) -> list[RequestOutput] | None:
    """Run a batch's requests (all running at once in the engine) to their ends; None if the client went
    away first."""
    async def lasts() -> list[RequestOutput]:
        outs = []
        for gen in gens:
            async for _ in gen.outputs():
                pass
            assert gen.last is not None  # a stream ends with its finished output
            outs.append(gen.last)
        return outs

    run = await _unless_gone(lasts(), disconnected)
    return None if run is None else run.result()


async def _unless_gone(work: Awaitable[_T], disconnected: Callable[[], Awaitable[object]]) -> asyncio.Future[_T] | None:
    """`work`'s finished future, or None (work cancelled) if the client went away first. Cancelled while
    waiting, neither helper outlives the call."""
    done = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({done, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        _settle(done, gone)
        raise
    _settle(gone)
    if not done.done():
        done.cancel()
        return None
    return done


def _settle(*tasks: asyncio.Future) -> None:
    """Helpers whose answer is no longer wanted: cancelled if still running, their error marked seen if they
    failed (else asyncio logs "exception was never retrieved" at error level when it collects them)."""
    for task in tasks:
        if not task.done():
            task.cancel()
        elif not task.cancelled():
            task.exception()


async def sse_events(gen: Generation, fmt: _Format, n: int, include_usage: bool,
                     continuous_usage: bool = False) -> AsyncIterator[str]:
    """The stream of `data:` events for one request, ending with `data: [DONE]`.

    continuous_usage (vLLM's continuous_usage_stats): every chunk carries the usage so far.
    """
    try:
        async for chunk in stream_chunks(gen, fmt, n, continuous_usage):
            yield event(chunk, include_usage)
    except KaonError as exc:  # the engine died under us: tell the client in-band, then stop
        yield error_event(exc)
        return
    if include_usage and gen.last is not None:
        yield event(fmt.usage_chunk(usage(gen.last)), include_usage)
    yield "data: [DONE]\n\n"


async def stream_chunks(gen: Generation, fmt: _Format, n: int, continuous_usage: bool = False
                        ) -> AsyncIterator[BaseModel]:
    """One request's chunks, its opening ones first (no usage chunk, no [DONE]: sse_events, batch.py)."""
    for chunk in fmt.opening_chunks(n):
        yield chunk
    sent_text = [0] * n
    sent_tokens = [0] * n
    finished = [False] * n
    async for output in gen.outputs():
        for c in output.outputs:
            if finished[c.index]:
                continue
            finished[c.index] = c.finish_reason is not None
            # A tail that may still become a stop string waits: the engine cuts a stop string
            # once all of it has appeared, and what was sent cannot be taken back.
            safe = len(c.text) - (0 if finished[c.index] else held_back(c.text, gen.stops))
            delta = c.text[sent_text[c.index]:safe]
            if not delta and not finished[c.index]:
                continue
            chunk = fmt.chunk(c, delta, sent_text[c.index], sent_tokens[c.index])
            sent_text[c.index], sent_tokens[c.index] = safe, len(c.token_ids)
            if continuous_usage:
                chunk.usage = usage(output)
            yield chunk


def error_event(exc: KaonError) -> str:
    error = p.ErrorResponse(error=p.ErrorInfo(message=str(exc), type="server_error", code=exc.code))
    return f"data: {error.model_dump_json()}\n\n"


def event(chunk: BaseModel, include_usage: bool) -> str:
    # OpenAI sends "usage": null on every chunk only when the client asked for usage.
    exclude = None if include_usage else {"usage"}
    return f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"


class _Format:
    """How one endpoint wraps choices: the whole response, and a stream's chunks."""

    def __init__(self, gen: Generation, tokenizer: Tokenizer):
        self.gen = gen
        self.tokenizer = tokenizer
        self.token_ids_as_names = False  # vLLM's return_tokens_as_token_ids: "token_id:42" for each token

    def token_name(self, token_id: int) -> str:
        """How a token appears in logprobs: its text, or "token_id:<id>" (exact where text splits characters)."""
        return f"token_id:{token_id}" if self.token_ids_as_names else self.tokenizer.token_to_str(token_id)

    def response(self, output: RequestOutput) -> BaseModel:
        raise NotImplementedError

    def opening_chunks(self, n: int) -> Sequence[BaseModel]:
        raise NotImplementedError

    def chunk(self, c: CompletionOutput, delta: str, text_offset: int,
              token_start: int) -> p.CompletionResponse | p.ChatCompletionChunk:
        raise NotImplementedError

    def usage_chunk(self, info: p.UsageInfo) -> BaseModel:
        raise NotImplementedError

    def _top(self, token_id: int, logprobs: dict[int, float]) -> tuple[str, float, list[tuple[str, float]]]:
        """The chosen token and the k most likely ones, as strings (the engine returns ids)."""
        # Under a grammar the forbidden tokens' logprobs are -inf: not alternatives, and not valid JSON numbers.
        best = sorted((item for item in logprobs.items() if item[1] > float("-inf")),
                      key=lambda item: -item[1])[:self.gen.num_logprobs]
        return (self.token_name(token_id), logprobs[token_id], [(self.token_name(t), lp) for t, lp in best])

    def _head(self) -> dict:
        return {"id": self.gen.request_id, "created": self.gen.created, "model": self.gen.model}


class CompletionFormat(_Format):
    def __init__(self, gen: Generation, tokenizer: Tokenizer, echo: bool = False, prompt_logprobs: int | None = None):
        super().__init__(gen, tokenizer)
        self.echo = echo  # the prompt (and, with logprobs, its logprobs) before each choice (server/echo.py)
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs on each choice

    def response(self, output: RequestOutput) -> p.CompletionResponse:
        head = prompt_text(output, self.tokenizer) if self.echo else ""
        prompt_part = (echoed_logprobs(output, self.token_name, self.gen.num_logprobs)
                       if self.echo and self.gen.num_logprobs is not None else None)
        scored = (vllm_prompt_logprobs(output, self.token_name, self.prompt_logprobs)
                  if self.prompt_logprobs is not None else None)
        choices = []
        for c in output.outputs:
            logprobs = _joined(prompt_part, self._logprobs(c, 0, len(head)))
            choices.append(p.CompletionChoice(index=c.index, text=head + c.text, logprobs=logprobs,
                                              finish_reason=c.finish_reason, prompt_logprobs=scored))
        return p.CompletionResponse(**self._head(), choices=choices, usage=usage(output))

    def opening_chunks(self, n: int) -> list[p.CompletionResponse]:
        return []

    def chunk(self, c: CompletionOutput, delta: str, text_offset: int, token_start: int) -> p.CompletionResponse:
        # With echo, a choice's first chunk opens with the prompt (and its logprobs), as vLLM streams it;
        # offsets count from the start of the prompt, as in the whole response.
        head, prompt_part = "", None
        if self.echo and self.gen.last is not None:
            head = prompt_text(self.gen.last, self.tokenizer)
            if token_start == 0 and self.gen.num_logprobs is not None:
                prompt_part = echoed_logprobs(self.gen.last, self.token_name, self.gen.num_logprobs)
        logprobs = _joined(prompt_part, self._logprobs(c, token_start, len(head) + text_offset))
        text = head + delta if token_start == 0 else delta
        choice = p.CompletionChoice(index=c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason)
        return p.CompletionResponse(**self._head(), choices=[choice])

    def usage_chunk(self, info: p.UsageInfo) -> p.CompletionResponse:
        return p.CompletionResponse(**self._head(), choices=[], usage=info)

    def _logprobs(self, c: CompletionOutput, start: int, text_offset: int) -> p.CompletionLogprobs | None:
        if self.gen.num_logprobs is None or c.logprobs is None:
            return None
        out = p.CompletionLogprobs()
        for token_id, logprobs in zip(c.token_ids[start:], c.logprobs[start:]):
            token, logprob, top = self._top(token_id, logprobs)
            out.tokens.append(token)
            out.token_logprobs.append(logprob)
            out.top_logprobs.append(legacy_top(top, token, logprob))
            out.text_offset.append(text_offset)
            text_offset += len(token)
        return out


class ChatFormat(_Format):
    def __init__(self, gen: Generation, tokenizer: Tokenizer, calling: ToolCalling | None = None,
                 prompt_logprobs: int | None = None):
        super().__init__(gen, tokenizer)
        self.calling = calling  # tools were offered: the text is read for calls
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs, on the response (not per choice)
        self._streams: dict[int, ToolCallStream] = {}

    def response(self, output: RequestOutput) -> p.ChatCompletionResponse:
        choices = []
        for c in output.outputs:
            message, finish_reason = assistant_message(c.text, c.finish_reason, self.calling)
            choices.append(p.ChatChoice(index=c.index, message=message, logprobs=self._logprobs(c, 0),
                                        finish_reason=finish_reason))
        scored = (vllm_prompt_logprobs(output, self.token_name, self.prompt_logprobs)
                  if self.prompt_logprobs is not None else None)
        return p.ChatCompletionResponse(**self._head(), choices=choices, usage=usage(output), prompt_logprobs=scored)

    def opening_chunks(self, n: int) -> list[p.ChatCompletionChunk]:
        # OpenAI opens each choice with the role and empty content.
        return [p.ChatCompletionChunk(**self._head(), choices=[
            p.ChatChunkChoice(index=i, delta=p.DeltaMessage(role="assistant", content=""))]) for i in range(n)]

    def chunk(self, c: CompletionOutput, delta: str, text_offset: int, token_start: int) -> p.ChatCompletionChunk:
        message, finish_reason = p.DeltaMessage(content=delta or None), c.finish_reason
        if self.calling is not None:
            stream = self._streams.setdefault(c.index, ToolCallStream(self.calling))
            content, calls = stream.update(delta, c.finish_reason is not None)
            message = p.DeltaMessage(content=content or None, tool_calls=calls or None)
            finish_reason = stream.finish_reason(c.finish_reason)
        choice = p.ChatChunkChoice(index=c.index, delta=message, logprobs=self._logprobs(c, token_start),
                                   finish_reason=finish_reason)
        return p.ChatCompletionChunk(**self._head(), choices=[choice])

    def usage_chunk(self, info: p.UsageInfo) -> p.ChatCompletionChunk:
        return p.ChatCompletionChunk(**self._head(), choices=[], usage=info)

    def _logprobs(self, c: CompletionOutput, start: int) -> p.ChoiceLogprobs | None:
        if self.gen.num_logprobs is None or c.logprobs is None:
            return None
        content = []
        for token_id, logprobs in zip(c.token_ids[start:], c.logprobs[start:]):
            token, logprob, top = self._top(token_id, logprobs)
            content.append(p.TokenLogprob(token=token, logprob=logprob, bytes=_bytes(token), top_logprobs=[
                p.TopLogprob(token=t, logprob=lp, bytes=_bytes(t)) for t, lp in top]))
        return p.ChoiceLogprobs(content=content)


def _joined(prompt_part: p.CompletionLogprobs | None, logprobs: p.CompletionLogprobs | None
            ) -> p.CompletionLogprobs | None:
    """The echoed prompt's logprobs, then the generated ones'."""
    if prompt_part is None or logprobs is None:
        return logprobs
    return p.CompletionLogprobs(**{name: getattr(prompt_part, name) + getattr(logprobs, name)
                                   for name in p.CompletionLogprobs.model_fields})


def _bytes(token: str) -> list[int] | None:
    # A token that splits a UTF-8 character decodes to U+FFFD; its true bytes are not known here.
    return None if "\ufffd" in token else list(token.encode())
