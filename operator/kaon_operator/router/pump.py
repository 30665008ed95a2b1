"""Copying an engine's response body to the client as it arrives, and how that ended.

The copy stops at the body's end, when the engine's connection fails, or when nothing came
for --idle-timeout; a client that stopped reading is not an idle engine (below). Streams go
through an sse.EventFramer, so that only whole events are passed on.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import NamedTuple, Protocol

import aiohttp


class Outcome(StrEnum):
    """How a response body that had begun ended."""

    COMPLETE = "complete"
    IDLE = "idle"
    """Nothing came for --idle-timeout."""
    BROKE_OFF = "broke off"
    """The engine's connection failed part way (Ended.reason says how)."""


class Ended(NamedTuple):
    outcome: Outcome
    reason: str = ""
    """With BROKE_OFF: the connection's error."""


class Framer(Protocol):
    pending: bytes

    def feed(self, chunk: bytes) -> bytes: ...

    def flush(self) -> bytes: ...


class Pump:
    """Copies `content` (the engine's body) through `framer` to `write` (the client's)."""

    def __init__(self, content: aiohttp.StreamReader, write: Callable[[bytes], Awaitable[None]], framer: Framer,
                 idle_timeout: float):
        self.content, self.write, self.framer, self.idle_timeout = content, write, framer, idle_timeout
        self.clock = asyncio.get_running_loop().time
        self.last = self.clock()
        """When the engine last sent something, or the client last took it."""
        self.writing = False

    async def run(self) -> Ended:
        # One timer per idle period rather than one per chunk (rescheduling a timer costs
        # about a tenth of relaying a chunk): when it fires, the stream is idle only if
        # nothing came since `last`; else it is set again.
        while True:
            try:
                async with asyncio.timeout_at(self.last + self.idle_timeout):
                    return await self._copy()
            except TimeoutError:
                if not self.writing and self.clock() - self.last >= self.idle_timeout:
                    return Ended(Outcome.IDLE)
                if self.writing and not self.framer.pending and self.content.at_eof():
                    return Ended(Outcome.COMPLETE)  # the timer fired in the last write
                self.writing, self.last = False, self.clock()

    async def _copy(self) -> Ended:
        while True:
            try:
                chunk = await self.content.readany()
            except aiohttp.ClientError as exc:
                return Ended(Outcome.BROKE_OFF, str(exc) or type(exc).__name__)
            self.last = self.clock()
            if not chunk:  # the end of the body
                if rest := self.framer.flush():
                    self.writing = True
                    await self.write(rest)
                return Ended(Outcome.COMPLETE)
            if data := self.framer.feed(chunk):
                await self._write(data)

    async def _write(self, data: bytes) -> None:
        # A slow client is not an idle engine: the time a write waits for the client to read
        # never counts. (A timer firing in the write stops only its wait for the client; the
        # data is already queued.)
        self.writing = True
        await self.write(data)
        self.writing = False
        self.last = self.clock()
