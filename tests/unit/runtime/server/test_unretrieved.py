"""The server's helper tasks that nobody awaits must not be left holding an exception nobody retrieves:
asyncio reports one at error level ("Task exception was never retrieved") whenever the garbage collector
takes it, late and unnamed, and the tests that forbid error-level logs fail on it (a race a busy machine
opens). Each case makes the failure happen, drops every reference, collects, and asserts that the loop's
exception handler heard nothing."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging

from kaon_runtime.engine.block_manager import BlockManager
from kaon_runtime.engine.kv_transfer import KvLayout
from kaon_runtime.engine.kv_wire import TcpTransport
from kaon_runtime.engine.remote_prefill import RemotePrefill
from kaon_runtime.server.serving import Generation, final_output


def unretrieved(scenario) -> list[dict]:
    """Run `scenario()` on a fresh loop; what asyncio's exception handler was told, after a collection."""
    heard: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: heard.append(context))
        await scenario()
        for _ in range(3):
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(main())
    return heard


class FailingStream:
    """A request's outputs that end in the engine's error once `fail` is set."""

    def __init__(self) -> None:
        self.fail = asyncio.Event()

    def __aiter__(self):
        return self

    async def __anext__(self):
        await self.fail.wait()
        raise RuntimeError("the engine died")


def never() -> asyncio.Future:
    return asyncio.get_running_loop().create_future()  # the client never goes


async def cancelled_while_waiting(work, stream: FailingStream) -> None:
    """Cancel `work` while it waits for the request, then let the request fail."""
    task = asyncio.ensure_future(work)
    for _ in range(3):
        await asyncio.sleep(0)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stream.fail.set()


def test_the_check_can_fail():
    async def scenario() -> None:
        stream = FailingStream()
        helper = asyncio.ensure_future(anext(stream))  # a helper nobody awaits or cancels
        del helper
        await asyncio.sleep(0)
        stream.fail.set()

    assert [type(c.get("exception")) for c in unretrieved(scenario)] == [RuntimeError]


def test_a_stream_start_cancelled_while_waiting_leaves_no_helper_behind():
    async def scenario() -> None:
        stream = FailingStream()
        gen = Generation("r", "m", stream, None, [], None)  # type: ignore[arg-type]  (no timer: never reached)
        await cancelled_while_waiting(gen.start(never), stream)

    assert unretrieved(scenario) == []


def test_a_whole_answer_cancelled_while_waiting_leaves_no_helper_behind():
    class Gen:
        last = None

        def __init__(self, stream: FailingStream):
            self.stream = stream

        async def outputs(self):
            async for output in self.stream:
                yield output

    async def scenario() -> None:
        stream = FailingStream()
        await cancelled_while_waiting(final_output(Gen(stream), never), stream)  # type: ignore[arg-type]

    assert unretrieved(scenario) == []


def test_a_release_that_fails_is_logged_not_left_unretrieved(caplog):
    async def engine_gone(fn):
        raise RuntimeError("the engine is not running")

    async def scenario() -> None:
        remote = RemotePrefill(["http://127.0.0.1:9"], TcpTransport(), KvLayout(1, 1, 4, "float32"),
                               BlockManager(4, 4), min_prompt_tokens=4)
        remote.engine_call = engine_gone
        remote._release(object())  # type: ignore[arg-type]  (never reaches the engine)
        await asyncio.wait(set(remote._releases))

    with caplog.at_level(logging.WARNING, logger="kaon_runtime.engine.remote_prefill"):
        heard = unretrieved(scenario)
    assert heard == []
    assert any("not given back" in r.getMessage() and "not running" in r.getMessage() for r in caplog.records)
