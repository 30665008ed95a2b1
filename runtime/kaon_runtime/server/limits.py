"""What one request may cost the engine, checked before any work is done for it, and the
connection deadlines that keep slow clients from holding the server.

A request is parsed (a few milliseconds at the body limit) and then checked here, before it is
tokenized, queued or generated: a prompt too long to fit by its bytes alone, more stop strings
(or longer ones) than the cap, or more log-probability entries than the server will serialize
are a 400 at once. Every limit is a `kaon serve` flag (add_flags), documented in docs/serving.md.
The CLI imports this module for its flags, so it imports neither torch nor the web stack.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kaon_runtime.errors import InvalidRequestError, QueueFullError

if TYPE_CHECKING:  # `kaon fetch` reads the flags: no torch, no web stack imported for them
    from kaon_runtime.engine.async_engine import AsyncEngine
    from kaon_runtime.sampling import SamplingParams
    from kaon_runtime.server import protocol as p

BYTES_PER_TOKEN_BOUND = 32
"""No tokenizer kaon loads has a token much longer than this (the longest are runs of spaces or
dashes), so a prompt of more than this many bytes per token of the context cannot fit it."""

MAX_QUEUE_WAIT_S = 30.0
"""`kaon serve --max-queue-wait`'s default, the admission limit past capacity (engine.admission): the
longest a request waits for its turn. Thirty seconds is inside the client timeouts of OpenAI's SDK (600 s,
and it retries a 503 after its Retry-After) and of load generators, and long enough that a burst within
--max-queue on a busy 2-core machine (64 chats at once: tests/integration/test_server.py, where 10 s
refused some) is served whole rather than refused.
"""


@dataclass(frozen=True, slots=True)
class Limits:
    max_prompt_bytes: int | None = None
    """A prompt (the chat's messages and tools together) longer than this many UTF-8 bytes is refused
    before it is tokenized. None: BYTES_PER_TOKEN_BOUND x the context length."""
    max_stop: int = 16
    """Stop strings per request (OpenAI allows 4)."""
    max_stop_chars: int = 256
    """Characters per stop string."""
    max_logprob_entries: int = 1 << 18
    """n x (top_logprobs + 1) x max_tokens, plus (prompt_logprobs + 1) x prompt tokens when the prompt is
    scored: the log-probability entries a response may carry."""
    header_timeout: float = 10.0
    """Seconds a connection may take to send a whole request head (a new one, or between requests)."""
    body_timeout: float = 30.0
    """Seconds to receive a request's body once its head is in; then the connection is closed."""
    max_connections: int = 2048
    """Connections (and requests) at once; past it uvicorn answers 503."""
    write_timeout: float = 30.0
    """Seconds a response may wait for a client that stopped reading (its socket buffer full); then
    the connection is dropped, which aborts the request and frees its sequence."""

    def prompt_bytes_limit(self, max_model_len: int) -> int:
        return self.max_prompt_bytes or BYTES_PER_TOKEN_BOUND * max_model_len


def add_flags(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    parser.add_argument("--max-prompt-bytes", type=int, default=d.max_prompt_bytes,
                        help="refuse (400) a prompt longer than this many UTF-8 bytes before tokenizing it "
                        f"(default: {BYTES_PER_TOKEN_BOUND} x the context length)")
    parser.add_argument("--max-stop", type=int, default=d.max_stop, help="stop strings per request")
    parser.add_argument("--max-stop-chars", type=int, default=d.max_stop_chars, help="characters per stop string")
    parser.add_argument("--max-logprob-entries", type=int, default=d.max_logprob_entries,
                        help="refuse (400) a request whose n x (top_logprobs + 1) x max_tokens (plus "
                        "(prompt_logprobs + 1) x prompt tokens, echo's included) exceeds this")
    parser.add_argument("--header-timeout", type=float, default=d.header_timeout,
                        help="seconds a connection may take to send a whole request head; then it is closed")
    parser.add_argument("--body-timeout", type=float, default=d.body_timeout,
                        help="seconds to receive a request body once its head is in; then it is closed")
    parser.add_argument("--max-connections", type=int, default=d.max_connections,
                        help="connections at once; past it new requests get a 503")
    parser.add_argument("--write-timeout", type=float, default=d.write_timeout,
                        help="seconds a response may wait for a client that stopped reading; then the "
                        "connection is dropped and its request aborted")


def from_args(args: argparse.Namespace) -> Limits:
    return Limits(max_prompt_bytes=args.max_prompt_bytes, max_stop=args.max_stop, max_stop_chars=args.max_stop_chars,
                  max_logprob_entries=args.max_logprob_entries, header_timeout=args.header_timeout,
                  body_timeout=args.body_timeout, max_connections=args.max_connections,
                  write_timeout=args.write_timeout)


# ---- per request: pure checks --------------------------------------------------------------


def check_prompt(prompt_bytes: int, prompt_tokens: int, limits: Limits, max_model_len: int) -> None:
    """`prompt_bytes`: the UTF-8 length of the text to tokenize; `prompt_tokens`: token ids sent as such."""
    limit = limits.prompt_bytes_limit(max_model_len)
    if prompt_bytes > limit:
        raise InvalidRequestError(f"the prompt is {prompt_bytes} bytes, more than this server tokenizes "
                                  f"({limit}, --max-prompt-bytes): it cannot fit the context of {max_model_len} "
                                  "tokens")
    if prompt_tokens > max_model_len:
        raise InvalidRequestError(f"the prompt is {prompt_tokens} tokens, more than the context of "
                                  f"{max_model_len}")


def check_stop(stop: list[str], limits: Limits) -> None:
    if len(stop) > limits.max_stop:
        raise InvalidRequestError(f"stop: {len(stop)} strings, at most {limits.max_stop} (--max-stop)")
    longest = max(map(len, stop), default=0)
    if longest > limits.max_stop_chars:
        raise InvalidRequestError(f"stop: a string of {longest} characters, at most {limits.max_stop_chars} "
                                  "(--max-stop-chars)")


def check_logprobs(n: int, top_logprobs: int | None, max_tokens: int | None, limits: Limits,
                   max_model_len: int) -> None:
    """`top_logprobs` None: no log-probabilities asked for; `max_tokens` None: up to the context."""
    if top_logprobs is None:
        return
    entries = n * (top_logprobs + 1) * (max_model_len if max_tokens is None else max_tokens)
    if entries > limits.max_logprob_entries:
        raise InvalidRequestError(f"n x (top_logprobs + 1) x max_tokens = {entries} log-probability entries, at most "
                                  f"{limits.max_logprob_entries} (--max-logprob-entries); ask for fewer tokens, "
                                  "choices or alternatives")


def check_prompt_logprobs(prompt_tokens: int, params: SamplingParams, limits: Limits, max_model_len: int) -> None:
    """Once the prompt's length is known: its scored tokens (vLLM's prompt_logprobs, or echo with
    logprobs) count against the same cap as the generated ones, which now fill at most the rest of
    the context."""
    if params.prompt_logprobs is None:
        return
    prompt_entries = (params.prompt_logprobs + 1) * prompt_tokens
    generated = 0
    if params.logprobs is not None:
        room = max(max_model_len - prompt_tokens, 0)
        generated = params.n * (params.logprobs + 1) * (room if params.max_tokens is None else params.max_tokens)
    if prompt_entries + generated > limits.max_logprob_entries:
        raise InvalidRequestError(
            f"(prompt_logprobs + 1) x {prompt_tokens} prompt tokens = {prompt_entries} log-probability entries"
            f"{f' and {generated} for the generated tokens' if generated else ''}, at most "
            f"{limits.max_logprob_entries} in all (--max-logprob-entries); score a shorter prompt or fewer "
            "alternatives")


def utf8_length(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


def check_completion(body: p.CompletionRequest, prompt: str | list[int], limits: Limits, max_model_len: int) -> None:
    text, ids = (prompt, []) if isinstance(prompt, str) else ("", prompt)
    keep = body.truncate_prompt_tokens  # vLLM's: the engine keeps the prompt's last k tokens (-1: the context's)
    num_ids = len(ids) if keep is None else min(len(ids), max_model_len if keep == -1 else max(keep, 0))
    check_prompt(utf8_length(text), num_ids, limits, max_model_len)
    check_stop(body.stop_list, limits)
    check_logprobs(body.n, body.logprobs, body.max_tokens, limits, max_model_len)


def check_chat(body: p.ChatCompletionRequest, max_tokens: int | None, limits: Limits, max_model_len: int) -> None:
    size = sum(utf8_length(m.text()) for m in body.messages)
    size += sum(utf8_length(t.model_dump_json()) for t in body.tools or ())
    check_prompt(size, 0, limits, max_model_len)
    check_stop(body.stop_list, limits)
    check_logprobs(body.n, (body.top_logprobs or 0) if body.logprobs else None, max_tokens, limits, max_model_len)


class Admission:
    """Requests between their checks and the engine's queue (their prompt being rendered and
    tokenized): counted with the engine's waiting ones against its queue bound, so that a full
    queue refuses a request before its prompt is tokenized, not after."""

    def __init__(self, engine: AsyncEngine):
        self.engine = engine
        self.preparing = 0

    @contextlib.contextmanager
    def slot(self) -> Iterator[None]:
        waiting = self.engine.stats().num_waiting + self.preparing
        if waiting >= self.engine.max_queue:
            raise QueueFullError(f"{waiting} requests are already waiting (limit {self.engine.max_queue})")
        self.preparing += 1
        try:
            yield
        finally:
            self.preparing -= 1


# ---- per connection: deadlines --------------------------------------------------------------


def deadline_protocol(header_timeout: float, body_timeout: float, write_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol with three deadlines it lacks: a request head must arrive whole within
    `header_timeout` (on a new connection, and from the first byte of a later one on a kept-alive
    connection), and a body within `body_timeout` of its head; past either the connection is closed.
    (uvicorn's keep-alive timer only runs while no byte of a next request has come.) And a client
    may leave the socket's buffer full (it stopped reading) for `write_timeout`: uvicorn's send
    waits for it without end, so a stream would hold its connection, and its sequence until
    max_tokens, forever. Then the connection is aborted (a close would wait for the buffer to
    drain), which the app sees as a disconnect: the stream's generation is aborted."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Deadlines(AutoHTTPProtocol):  # type: ignore[valid-type, misc]
        def connection_made(self, transport) -> None:
            self._deadline: asyncio.TimerHandle | None = None
            self._phase = ""  # what the deadline armed is for: "head" or "body"
            self._watched = None  # the request whose body has the deadline
            self._stalled: asyncio.TimerHandle | None = None  # armed while the client takes no bytes
            super().connection_made(transport)
            self._arm(header_timeout, "head")

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            cycle = self.cycle
            if cycle is None or cycle.response_complete:  # between requests: this byte begins a head
                if self._phase != "head":
                    self._arm(header_timeout, "head")
            elif cycle is not self._watched:  # a head came whole: now its body has a deadline
                self._watched = cycle
                if cycle.more_body:
                    self._arm(body_timeout, "body")
                else:
                    self._cancel()

        def connection_lost(self, exc) -> None:
            self._cancel()
            self._unstall()
            super().connection_lost(exc)

        def pause_writing(self) -> None:
            super().pause_writing()
            self._unstall()
            self._stalled = self.loop.call_later(write_timeout, self.transport.abort)

        def resume_writing(self) -> None:
            self._unstall()
            super().resume_writing()

        def _unstall(self) -> None:
            if self._stalled is not None:
                self._stalled.cancel()
                self._stalled = None

        def _arm(self, seconds: float, phase: str) -> None:
            self._cancel()
            self._deadline, self._phase = self.loop.call_later(seconds, self._expired), phase

        def _cancel(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._phase = None, ""

        def _expired(self) -> None:
            cycle, phase = self.cycle, self._phase
            self._deadline, self._phase = None, ""
            idle = cycle is None or cycle.response_complete
            if (phase == "head" and idle) or (phase == "body" and cycle is not None and cycle.more_body):
                self.transport.close()  # a request still reading its body sees a disconnect

    return Deadlines
