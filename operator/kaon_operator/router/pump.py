"""Copying an engine's response body to the client as it arrives, and how that ended.

The copy stops at the body's end, when the engine's connection fails, when nothing came for
--idle-timeout, or when one write waited --write-timeout for the client to take it (its socket
buffer full: a client that stopped reading). The two deadlines never mix: the time a write
waits for the client is not the engine's idleness. Streams go through an sse.EventFramer, so
that only whole events are passed on.
"""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import NamedTuple, Protocol

import aiohttp

from kaon_operator.router.upstream import UpstreamError


class Outcome(StrEnum):
    """How a response body that had begun ended."""

    COMPLETE = "complete"
    IDLE = "idle"
    """Nothing came for --idle-timeout."""
    BROKE_OFF = "broke off"
    """The engine's connection failed part way (Ended.reason says how)."""
    STALLED = "stalled"
    """The client took no bytes of one write for --write-timeout."""


class Ended(NamedTuple):
    outcome: Outcome
    reason: str = ""
    """With BROKE_OFF: the connection's error."""


class Body(Protocol):
    async def readany(self) -> bytes: ...


class Framer(Protocol):
    pending: bytes

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class Pump:
    """Copies `content` (the engine's body) through `framer` to `write` (the client's)."""

    def __init__(self, content: aiohttp.StreamReader | Body, write: Callable[[bytes], Awaitable[None]], framer: Framer,
                 idle_timeout: float, write_timeout: float):
        self.content, self.write, self.framer = content, write, framer
        self.idle_timeout, self.write_timeout = idle_timeout, write_timeout
        self.clock = asyncio.get_running_loop().time
        self.last = self.clock()
        """When the engine last sent something, or the client last took it."""
        self.writing_since: float | None = None
        """When the write now waiting for the client began; None between writes."""

    async def run(self) -> Ended:
        # The copy runs as its own task and this one wakes a few times per deadline rather than
        # once per chunk (a timer per chunk costs about a tenth of relaying it). A write that
        # begins to wait does not wake it, so while none waits it looks every quarter of
        # --write-timeout: a stalled client is dropped within 1.25 x --write-timeout.
        copy = asyncio.ensure_future(self._copy())
        try:
            while True:
                now = self.clock()
                if self.writing_since is not None and now >= self.writing_since + self.write_timeout:
                    return Ended(Outcome.STALLED)
                if self.writing_since is None and now >= self.last + self.idle_timeout:
                    return Ended(Outcome.IDLE)
                done, _ = await asyncio.wait((copy,), timeout=self._next_look(now) - now)
                if done:
                    return copy.result()
        finally:
            if not copy.done():
                copy.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await copy
            elif not copy.cancelled():
                copy.exception()  # it failed as a deadline ended the pump (or the pump was cancelled): seen

    def _next_look(self, now: float) -> float:
        if self.writing_since is not None:
            return self.writing_since + self.write_timeout
        return min(self.last + self.idle_timeout, now + self.write_timeout / 4)

    async def _copy(self) -> Ended:
        while True:
            try:
                chunk = await self.content.readany()
            except (aiohttp.ClientError, UpstreamError) as exc:
                return Ended(Outcome.BROKE_OFF, str(exc) or type(exc).__name__)
            self.last = self.clock()
            if not chunk:  # the end of the body
                if rest := self.framer.flush():
                    await self._write(rest)
                return Ended(Outcome.COMPLETE)
            if data := self.framer.feed(chunk):
                await self._write(data)

    async def _write(self, data: bytes) -> None:
        # Most writes return at once (the data fits the socket's buffer); one that waits, waits
        # for the client to read, which counts against --write-timeout and not --idle-timeout.
        self.writing_since = self.last
        try:
            await self.write(data)
        finally:
            self.writing_since = None
        self.last = self.clock()
