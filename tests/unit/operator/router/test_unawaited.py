"""Futures and tasks of the router that nobody awaits must not hold an exception nobody retrieves: asyncio
reports one at error level ("... exception was never retrieved") whenever the garbage collector takes it,
which the tests that forbid error-level logs (test_front's fuzz) turn into a failure on a busy machine.

Each case makes the failure happen, drops every reference, collects, and asserts that the loop's exception
handler heard nothing (and, where the code logs it, that a warning names it)."""
from __future__ import annotations

import asyncio
import gc
import logging

from kaon_operator.router import unawaited
from kaon_operator.router.endpoints import Endpoint
from kaon_operator.router.front import Front, FrontProtocol
from kaon_operator.router.kv_feed import KvFeed
from kaon_operator.router.kv_index import KvIndex


def unretrieved(scenario) -> list[dict]:
    """Run `scenario()` on a fresh loop; what asyncio's exception handler was told, after a collection."""
    heard: list[dict] = []

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(lambda loop, context: heard.append(context))
        await scenario()
        for _ in range(3):  # the done callbacks run one loop turn after the task ends
            await asyncio.sleep(0)
        gc.collect()

    asyncio.run(main())
    return heard


def test_a_kept_task_that_fails_is_logged_and_its_exception_retrieved(caplog):
    kept: set[asyncio.Task] = set()
    log = logging.getLogger("kaon.test.unawaited")

    async def fails() -> None:
        raise RuntimeError("the check broke")

    async def scenario() -> None:
        await asyncio.wait({unawaited.keep(kept, asyncio.ensure_future(fails()), log, "a background check")})

    with caplog.at_level(logging.WARNING, logger="kaon.test.unawaited"):
        heard = unretrieved(scenario)
    assert heard == []
    assert not kept  # held while it ran, dropped once done
    assert [r.getMessage() for r in caplog.records] == ["a background check failed: RuntimeError('the check broke')"]


def test_the_check_itself_hears_an_unretrieved_exception():
    """The harness can fail: a task left failed and unreferenced is reported to the handler."""
    async def fails() -> None:
        raise RuntimeError("nobody looks")

    async def scenario() -> None:
        task = asyncio.ensure_future(fails())
        await asyncio.sleep(0)
        assert task.done()

    heard = unretrieved(scenario)
    assert [type(c.get("exception")) for c in heard] == [RuntimeError]


def test_a_kv_event_follower_that_fails_is_logged_not_left_unretrieved(caplog, monkeypatch):
    feed = KvFeed(KvIndex())

    async def follow_fails(endpoint: Endpoint) -> None:
        raise OSError("the pod's events socket refused")

    monkeypatch.setattr(feed, "_follow", follow_fails)
    pod = Endpoint("ns", "engine-0", "svc", "http://127.0.0.1:9")

    async def scenario() -> None:
        feed.follow([pod])
        await asyncio.sleep(0)
        feed.follow([])  # the pod left: its (failed) follower is dropped
        await feed.close()

    with caplog.at_level(logging.WARNING, logger="kaon_operator.router.kv_feed"):
        heard = unretrieved(scenario)
    assert heard == []
    assert any("following engine-0's KV events failed" in r.getMessage() for r in caplog.records)


class _Transport(asyncio.Transport):
    def get_extra_info(self, name, default=None):
        return ("127.0.0.1", 1) if name == "peername" else default

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        pass


def test_a_client_gone_while_writing_was_paused_leaves_no_unretrieved_future():
    """The third CI rehearsal's failure (2026-11-29): the front paused writing (the client reads slowly),
    the client hung up, and nobody was in drain() to take the error connection_lost set."""
    async def scenario() -> None:
        protocol = FrontProtocol(Front({}, None, max_body_bytes=1024, header_timeout=10.0))  # type: ignore[arg-type]
        protocol.connection_made(_Transport())
        protocol.pause_writing()
        protocol.connection_lost(ConnectionResetError())

    assert unretrieved(scenario) == []
