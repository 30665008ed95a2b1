"""AsyncEngine: the LLMEngine loop on its own thread, fed and drained from an asyncio event loop.

The model's forward pass is long, blocking work, so it never runs on the event loop. Requests
and aborts cross into the engine thread through a thread-safe queue (the engine itself is only
ever touched by that thread); outputs come back with `loop.call_soon_threadsafe`, one hop per
step for the whole batch.

Liveness means progress: the engine thread stamps the time of every completed step, and
`health()` reports a stall when requests are pending and no step has completed for
`stall_timeout_s` (a wedged collective, a GPU fault, a deadlock), so a liveness probe on
/health restarts the pod instead of leaving it accepting requests it never answers.

Over 300 lines for a stated reason: the thread hand-off (queue in, call_soon_threadsafe out), the
stall watch and the streams that consume the outputs share one piece of state and one lock order.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kaon_runtime.engine.admission import (
    FinishRate,
    StepTimes,
    admission,
    expected_wait_s,
    retry_after_s,
    start_deadline_s,
)
from kaon_runtime.engine.kv_transfer import ImportedKv
from kaon_runtime.engine.llm_engine import EngineStats, LLMEngine
from kaon_runtime.engine.output_kinds import Deltas, deltas_for
from kaon_runtime.engine.outputs import RequestOutput
from kaon_runtime.errors import EngineDeadError, OverloadedError, QueueFullError
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.sampling import RequestOutputKind, SamplingParams
from kaon_runtime.structured.spec import spec_for

if TYPE_CHECKING:
    from kaon_runtime.engine.remote_prefill import RemotePrefill

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    lora_id: int = 0
    kv: ImportedKv | None = None  # its prompt's K/V from a prefill engine
    admitted: bool = False  # a batch's prompt (admit_batch): never expired while it waits


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    """Run `fn(engine)` on the engine thread between steps (sleep and wake: engine/sleep.py)."""
    fn: Callable[[LLMEngine], Any]
    done: Future = field(default_factory=Future)


_STOP = object()

DEFAULT_STALL_TIMEOUT_S = 120.0
# The first step after load may compile kernels or capture graphs (minutes on a large model),
# so it gets this many stall timeouts. Later steps are bounded by max_num_batched_tokens
# (chunked prefill), so a long prompt does not make one step long.
FIRST_STEP_ALLOWANCE = 3
# Grammars compile on threads of their own, not the default pool that validates (tokenizes) every
# request: a flood of large grammars waits for these, and ordinary prompts do not wait behind it.
GRAMMAR_THREADS = 2
MAX_PENDING_COMPILES = 16  # compiling or waiting to; past it a constrained request gets a 429
COMPILE_TIMEOUT_S = 10.0  # a grammar not compiled by then is a 400, and its compile process is killed


class RequestStream:
    """Async iterator over one request's outputs; each output is cumulative, the last is finished
    (as the params' output_kind says: vLLM's DELTA gives what is new since the output read before,
    FINAL_ONLY only the finished output; engine/output_kinds.py).

    The engine's outputs are cumulative, so a consumer that falls behind loses nothing by skipping
    to the newest one: the stream keeps only the latest and never grows.
    """

    def __init__(self, request_id: str, engine: AsyncEngine,
                 output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE, deltas: Deltas | None = None):
        self.request_id = request_id
        self._engine = engine
        self._final_only = output_kind is RequestOutputKind.FINAL_ONLY
        self._deltas = deltas
        self._latest: RequestOutput | BaseException | None = None
        self._ready = asyncio.Event()
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        while True:
            await self._ready.wait()
            self._ready.clear()
            item, self._latest = self._latest, None
            assert item is not None, "the event is set only with an item"
            if isinstance(item, BaseException):
                self._done = True
                raise item
            if item.finished or not self._final_only:
                break
        self._done = item.finished
        return self._deltas.take(item) if self._deltas is not None else item

    def abort(self) -> None:
        """Stop the request (client gone, server shutting down); a no-op once it has finished."""
        if not self._done:
            self._done = True
            self._engine._submit(_Abort(self.request_id))

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._latest = item
        self._ready.set()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int = 256, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 max_queue_wait_s: float | None = None, max_running: int = 0):
        """`max_queue_wait_s`: the admission limit (engine.admission), None: requests wait for their turn
        as long as it takes; `max_running`: the scheduler's running slots (max_num_seqs; 0: counted as none
        free), which a new request takes without waiting."""
        self.engine = engine
        self.max_queue = max_queue
        self.max_queue_wait_s = max_queue_wait_s
        self.max_running = max_running
        self._finishes = FinishRate()  # the queue's drain rate, for refusing at once what would wait too long
        self._step_times = StepTimes()  # the engine thread's recent steps: a prompt's step counts against the limit
        self.stall_timeout_s = stall_timeout_s
        # Written by the engine thread, read by health(): floats and bools are replaced whole.
        self._progress_at = time.monotonic()  # last completed step, or when work arrived to an idle engine
        self._idle = True  # blocked waiting for work (so not stuck in a step)
        self._steps = 0
        self._intake: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # guards the admission count below against the engine thread
        self._num_queued = 0  # accepted here, not yet handed to the engine
        self._grammar_pool = ThreadPoolExecutor(GRAMMAR_THREADS, thread_name_prefix="kaon-grammar")
        self._compiles = 0  # submitted to the grammar pool and not finished (timed-out ones included)
        self._stats = engine.stats()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.refuse_new: Callable[[], BaseException | None] = lambda: None
        """Read on the engine thread for every request it takes: an error fails the request instead (asleep)."""
        self._unexpiring: set[str] = set()  # batch prompts let in by admit_batch, never expired (engine thread only)
        # A decode engine's prefill engines (engine.remote_prefill); None: every prompt is prefilled here.
        self.remote_prefill: RemotePrefill | None = None

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

    def health(self, now: float | None = None) -> str | None:
        """None when healthy; else why not: the loop is dead, or it has stalled with work pending."""
        if not self.is_alive:
            return "the engine loop is not running"
        if self._idle or not self.stall_timeout_s:
            return None
        stats = self._stats
        pending = self._num_queued + stats.num_waiting + stats.num_running
        allowed = self.stall_timeout_s * (1 if self._steps else FIRST_STEP_ALLOWANCE)
        stalled_for = (time.monotonic() if now is None else now) - self._progress_at
        if pending and stalled_for > allowed:
            return (f"the engine has stalled: no step completed for {stalled_for:.0f} s with {pending} request(s) "
                    f"pending (stall timeout {allowed:.0f} s)")
        return None

    def stats(self) -> EngineStats:
        """The engine's counters as of its last step (safe to read from any thread)."""
        return self._stats

    # What the server reads of the model; all fixed once the engine is built, so safe from any thread.

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        """Longest prompt + completion, in tokens."""
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    # LoRA adapters: the pool locks its own maps, so these run off the engine thread.

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, directory or the URI it came from) of every adapter requests may name."""
        return self.engine.lora_adapters()

    async def add_lora(self, name: str, path: str, source: str | None = None) -> None:
        """Read and register an adapter (on a worker thread; `source`: the URI it was downloaded from);
        InvalidRequestError says why it does not fit."""
        await asyncio.to_thread(self.engine.add_lora, name, path, source)

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter (ModelNotFoundError if unknown); requests using it finish with it."""
        self.engine.remove_lora(name)

    def admit_batch(self, num_prompts: int) -> None:
        """Judge a batch of prompts (one /v1/completions request) as one request, before any is queued: room
        for all of them in the queue (else QueueFullError, a 429) and its first prompt's turn within the
        admission limit (else OverloadedError, a 503). Its prompts are then added with `admitted=True`: none is
        refused or expired on its own, so a batch runs whole, as vLLM's does, or is refused whole."""
        with self._lock:
            waiting = self._num_queued + self._stats.num_waiting
            if waiting + num_prompts > self.max_queue:
                raise QueueFullError(f"a batch of {num_prompts} prompts needs that many places in the queue; "
                                     f"{waiting} requests are already waiting (limit {self.max_queue}, --max-queue)",
                                     retry_after_s(None, 0.0))
            refusal = self._refusal()
            if refusal is not None:
                raise refusal

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          adapter: str | None = None, admitted: bool = False) -> RequestStream:
        """Validate and queue a request (with the LoRA adapter of that name; None: the base model); raises
        InvalidRequestError, ModelNotFoundError (an unknown adapter), QueueFullError or EngineDeadError.
        `admitted`: a prompt of a batch that admit_batch let in: queued without its own admission check, and
        never expired while it waits (the batch's first prompt bounds the response's first token).

        Validation (tokenizing included) runs on a worker thread, so bad input is refused here,
        before the engine loop sees it, without blocking the event loop on a long prompt.
        """
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        lora_id = self.engine.lora_id(adapter)
        if spec_for(params) is not None:  # compiled (and cached) first, on the grammar threads
            await self._compile(params)
        prompt_token_ids = await asyncio.to_thread(self.engine.validate, prompt, params)
        kv = None
        if self.remote_prefill is not None and self._num_queued + self._stats.num_waiting < self.max_queue:
            kv = await self.remote_prefill.fetch(prompt_token_ids, params, adapter, lora_id)
        with self._lock:
            refusal = None if admitted else self._refusal()
            if refusal is not None:
                if kv is not None and kv.reservation is not None:  # its blocks go back (on the engine thread)
                    self._submit(_Call(lambda engine: engine.discard_imported(kv)))
                raise refusal
            self._num_queued += 1
        stream = RequestStream(request_id, self, params.output_kind, deltas_for(params))
        self._submit(_Add(request_id, prompt_token_ids, params, stream, lora_id, kv, admitted))
        return stream

    def _refusal(self) -> QueueFullError | OverloadedError | None:
        """The admission judgment of one more request now (under self._lock): a full queue (429) or a wait past
        --max-queue-wait (503), as the error to raise; None: let it in."""
        stats = self._stats
        waiting = self._num_queued + stats.num_waiting
        wait = expected_wait_s(waiting, max(self.max_running - stats.num_running, 0),
                               self._finishes.rate(time.monotonic()), self._step_times.slowest())
        refusal = admission(waiting, self.max_queue, wait, self.max_queue_wait_s)
        if refusal is None:
            return None
        error = QueueFullError if refusal.status == 429 else OverloadedError
        return error(refusal.reason, refusal.retry_after_s)

    async def _compile(self, params: SamplingParams) -> None:
        if self._compiles >= MAX_PENDING_COMPILES:
            raise QueueFullError(f"{self._compiles} grammars are compiling or waiting to "
                                 f"(limit {MAX_PENDING_COMPILES})")
        self._compiles += 1
        # The deadline is the compile's own (structured/compiler.py): past it, its process is killed and the
        # thread is free again, so a flood of costly grammars leaves no compile running behind its 400.
        future = self._grammar_pool.submit(self.engine.grammars.check, params, COMPILE_TIMEOUT_S)
        loop = asyncio.get_running_loop()
        # Counted until its thread is done, not until the request gives up: the bound is on the threads' work.
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._compiled))
        await asyncio.shield(asyncio.wrap_future(future))  # a client gone does not cut a compile (it is cached)

    def _compiled(self) -> None:
        self._compiles -= 1

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run `fn(engine)` on the engine thread between steps; its result, or its exception."""
        if not self.is_alive:
            raise EngineDeadError("the engine is not running")
        command = _Call(fn)
        self._submit(command)
        return await asyncio.wrap_future(command.done)

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        self._intake.put(command)

    # ---- engine thread -----------------------------------------------------------------

    def _run(self) -> None:
        streams: dict[str, RequestStream] = {}
        try:
            while True:
                # Idle: sleep until a command arrives. Busy: pick up what came in, then step.
                commands = self._take_commands(block=not self.engine.has_unfinished_requests())
                if self._idle:  # work arrived: the stall clock starts now, not at the last step
                    self._progress_at, self._idle = time.monotonic(), False
                self._apply(commands, streams)
                if _STOP in commands:
                    break
                if self.max_queue_wait_s is not None:
                    self._expire(streams)
                if self.engine.has_unfinished_requests():
                    began = time.monotonic()
                    self._deliver(self.engine.step(), streams)
                    self._stats = self.engine.stats()
                    self._progress_at, self._steps = time.monotonic(), self._steps + 1
                    with self._lock:
                        self._step_times.record(self._progress_at - began)
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
        if block:
            self._idle = True
        commands = [self._intake.get()] if block else []
        while True:
            try:
                commands.append(self._intake.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list, streams: dict[str, RequestStream]) -> None:
        added = 0
        for command in commands:
            if isinstance(command, _Call):
                _run_call(command, self.engine)
                self._fail_dropped(streams)
            elif isinstance(command, _Add):
                added += 1
                refused = self.refuse_new()
                if refused is not None:
                    if command.kv is not None:  # its reserved blocks go back
                        self.engine.discard_imported(command.kv)
                    self._event_loop().call_soon_threadsafe(command.stream._put, refused)
                    continue
                try:
                    self.engine.add_validated(command.request_id, command.prompt_token_ids, command.params,
                                              lora_id=command.lora_id, kv=command.kv)
                    if command.admitted:
                        self._unexpiring.add(command.request_id)
                except Exception as exc:  # noqa: BLE001 -- validated already; only a duplicate id can get here, and its stream gets the error
                    if command.kv is not None:
                        self.engine.discard_imported(command.kv)
                    self._event_loop().call_soon_threadsafe(command.stream._put, exc)
                    continue
                streams[command.request_id] = command.stream
            elif isinstance(command, _Abort) and streams.pop(command.request_id, None) is not None:
                self.engine.abort_request(command.request_id)
        # Moving requests from our queue into the engine's waiting list, and publishing the
        # counts, in one step keeps the admission check from seeing them twice or not at all.
        with self._lock:
            self._num_queued -= added
            self._stats = self.engine.stats()

    def _expire(self, streams: dict[str, RequestStream]) -> None:
        """Answer the queued requests that waited past the admission limit: a 503 each, not a silent wait.
        Their deadline leaves room for the step that would compute their prompt, so that a request that does
        get its turn has its first token within the limit."""
        assert self.max_queue_wait_s is not None
        with self._lock:
            deadline = start_deadline_s(self.max_queue_wait_s, self._step_times.slowest())
        self._unexpiring &= streams.keys()  # those that finished or went are forgotten
        expired = self.engine.expire_waiting(deadline, keep=frozenset(self._unexpiring))
        if not expired:
            return
        with self._lock:
            rate = self._finishes.rate(time.monotonic())
        waiting = self.engine.stats().num_waiting
        retry = retry_after_s(waiting / rate if rate else None, self.max_queue_wait_s)
        failed: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        for request_id in expired:
            stream = streams.pop(request_id, None)
            if stream is not None:
                failed.append((stream, OverloadedError(
                    f"the server is past its capacity: the request waited {deadline:.3g} s without its turn, and its "
                    f"first token would come later than the admission limit of {self.max_queue_wait_s:g} s "
                    "(--max-queue-wait)", retry)))
        self._event_loop().call_soon_threadsafe(_put_all, failed)
        with self._lock:
            self._stats = self.engine.stats()

    def _fail_dropped(self, streams: dict[str, RequestStream]) -> None:
        """Fail the open streams once a call has left the engine without requests (a sleep aborts what is left)."""
        if streams and not self.engine.has_unfinished_requests():
            self._fail_all(streams, self.refuse_new() or EngineDeadError("the request was stopped by an "
                                                                         "administrative call"))

    def _event_loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop, where the streams live (known once `start` ran)."""
        assert self._loop is not None, "the engine thread runs only after start()"
        return self._loop

    def _deliver(self, outputs: list[RequestOutput], streams: dict[str, RequestStream]) -> None:
        batch: list[tuple[RequestStream, RequestOutput | BaseException]] = []
        finished = 0
        for output in outputs:
            stream = streams.get(output.request_id)
            if stream is not None:
                batch.append((stream, output))
                if output.finished:
                    del streams[output.request_id]
                    finished += 1
        if finished:
            with self._lock:
                self._finishes.record(time.monotonic(), finished)
        if batch:
            self._event_loop().call_soon_threadsafe(_put_all, batch)

    def _fail_all(self, streams: dict[str, RequestStream], exc: BaseException) -> None:
        failed: list[tuple[RequestStream, RequestOutput | BaseException]] = [(s, exc) for s in streams.values()]
        self._event_loop().call_soon_threadsafe(_put_all, failed)
        streams.clear()


def _run_call(command: _Call, engine: LLMEngine) -> None:
    if not command.done.set_running_or_notify_cancel():  # its caller gave up while it was queued: not run (setting
        return  # a cancelled future's result would raise here, on the engine thread)
    try:
        command.done.set_result(command.fn(engine))
    except Exception as exc:  # noqa: BLE001 -- handed to the caller, which raises it
        command.done.set_exception(exc)


def _put_all(batch: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream._put(item)
