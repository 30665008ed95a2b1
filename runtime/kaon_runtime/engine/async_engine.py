"""AsyncEngine: the LLMEngine loop on its own thread, fed and drained from an asyncio event loop.

The model's forward pass is long, blocking work, so it never runs on the event loop. Requests
and aborts cross into the engine thread through a thread-safe queue (the engine itself is only
ever touched by that thread); outputs come back with `loop.call_soon_threadsafe`, one hop per
step for the whole batch.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass

from kaon_runtime.engine.llm_engine import EngineStats, LLMEngine
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.errors import EngineDeadError, QueueFullError
from kaon_runtime.sampling import SamplingParams

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream


@dataclass(slots=True)
class _Abort:
    request_id: str


_STOP = object()


class RequestStream:
    """Async iterator over one request's outputs; each output is cumulative, the last is finished.

    Outputs are cumulative, so a consumer that falls behind loses nothing by skipping to the
    newest one: the stream keeps only the latest and never grows.
    """

    def __init__(self, request_id: str, engine: AsyncEngine):
        self.request_id = request_id
        self._engine = engine
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        await self._ready.wait()
        self._ready.clear()
        item, self._latest = self._latest, None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def abort(self) -> None:
        """Stop the request (client gone, server shutting down); a no-op once it has finished."""
        if not self._done:
            self._done = True
            self._engine._submit(_Abort(self.request_id))

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._latest = item
        self._ready.set()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256):
        self.engine = engine
        self.max_queue = max_queue
        self._intake: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards the admission count below against the engine thread
        self._num_queued = 0  # accepted here, not yet handed to the engine
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ---- event-loop side ---------------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; outputs are delivered to the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="kaon-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Abort whatever is left and wait for the engine thread to end."""
        if self._thread is not None:
            self._intake.put(_STOP)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (safe to read from any thread)."""
        return self._stats

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> RequestStream:
        """Validate and queue a request; raises InvalidRequestError, QueueFullError or EngineDeadError.

        Validation (tokenizing included) runs on a worker thread, so bad input is refused here,
        before the engine loop sees it, without blocking the event loop on a long prompt.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        prompt_token_ids = await asyncio.to_thread(self.engine.validate, prompt, params)
        with self._lock:
            waiting = self._num_queued + self._stats.num_waiting
            if waiting >= self.max_queue:
                raise QueueFullError(f"{waiting} requests are already waiting (limit {self.max_queue})")
            self._num_queued += 1
        stream = RequestStream(request_id, self)
        self._submit(_Add(request_id, prompt_token_ids, params, stream))
        return stream

    def _submit(self, command: _Add | _Abort) -> None:
        self._intake.put(command)

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        streams: dict[str, RequestStream] = {}
        try:
            while True:
                # Idle: sleep until a command arrives. Busy: pick up what came in, then step.
                commands = self._take_commands(block=not self.engine.has_unfinished_requests())
                self._apply(commands, streams)
                if _STOP in commands:
                    break
                if self.engine.has_unfinished_requests():
                    self._deliver(self.engine.step(), streams)
                    self._stats = self.engine.stats()
        except BaseException as exc:  # a bug in the engine: fail every request, refuse new ones
            logger.exception("engine loop crashed")
            self._error = exc
            self._fail_all(streams, EngineDeadError(f"the engine loop crashed: {exc!r}"))
            return
        for request_id in list(streams):
            self.engine.abort_request(request_id)
        self._fail_all(streams, EngineDeadError("the engine was shut down"))
        self._stats = self.engine.stats()

    def _take_commands(self, block: bool) -> list:
        commands = [self._intake.get()] if block else []
        while True:
            try:
                commands.append(self._intake.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list, streams: dict[str, RequestStream]) -> None:
        added = 0
        for command in commands:
            if isinstance(command, _Add):
                added += 1
                try:
                    self.engine.add_request(command.request_id, command.prompt_token_ids, command.params)
                except Exception as exc:  # validated already; only a duplicate id can get here
                    self._loop.call_soon_threadsafe(command.stream._put, exc)
                    continue
                streams[command.request_id] = command.stream
            elif isinstance(command, _Abort) and streams.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
        # Moving requests from our queue into the engine's waiting list, and publishing the
        # counts, in one step keeps the admission check from seeing them twice or not at all.
        with self._lock:
            self._num_queued -= added
            self._stats = self.engine.stats()

    def _deliver(self, outputs: list[RequestOutput], streams: dict[str, RequestStream]) -> None:
        batch = []
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                batch.append((stream, output))
                if output.finished:
                    del streams[output.request_id]
        if batch:
            self._loop.call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, streams: dict[str, RequestStream], exc: BaseException) -> None:
        self._loop.call_soon_threadsafe(_put_all, [(s, exc) for s in streams.values()])
        streams.clear()


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)
