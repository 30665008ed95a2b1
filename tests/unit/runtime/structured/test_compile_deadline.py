"""A grammar past its compile deadline stops compiling: its CPU and its thread are given back, not only its
request answered (structured/compile_worker.py: a forked child, killed). Through AsyncEngine.add_request,
the server's way in."""
from __future__ import annotations

import asyncio

import psutil
import pytest

from kaon_runtime import SamplingParams
from kaon_runtime.engine import async_engine
from kaon_runtime.errors import InvalidRequestError


def costly(tag: str) -> SamplingParams:
    """Within every grammar limit, yet seconds of xgrammar's work (8 objects of 250 optional properties)."""
    schema = {"type": "object", "properties": {
        f"{tag}{j}": {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(250)}}
        for j in range(8)}}
    return SamplingParams(json_schema=schema, max_tokens=2)


def live_children() -> list[psutil.Process]:
    """This process's children still running (a killed compile is reaped: gone from the list)."""
    return [c for c in psutil.Process().children(recursive=True)
            if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]


def test_a_grammar_past_its_deadline_gives_its_compile_thread_and_cpu_back(llm, monkeypatch):
    front = async_engine.AsyncEngine(llm.engine)

    async def run():
        front.start()
        try:
            monkeypatch.setattr(async_engine, "COMPILE_TIMEOUT_S", 0.05)
            children = {c.pid for c in live_children()}
            with pytest.raises(InvalidRequestError, match="did not compile within"):
                await front.add_request("costly", "hi", costly("k_"))
            # Its compile stopped with it: no grammar work left on a grammar thread (it used to go on for
            # seconds there, counted against MAX_PENDING_COMPILES), and no compile process left running.
            assert front._compiles == 0
            assert {c.pid for c in live_children()} <= children
            # And the next client's grammar compiles at once, in full time.
            monkeypatch.setattr(async_engine, "COMPILE_TIMEOUT_S", 10.0)
            stream = await front.add_request("small", "yes or no?",
                                             SamplingParams(choice=["yes", "no"], temperature=0, max_tokens=4))
            return [o async for o in stream][-1]
        finally:
            await front.stop()

    out = asyncio.run(run())
    assert out.outputs[0].text in ("yes", "no")


def test_a_grammar_the_compiler_refuses_in_its_process_is_a_clear_invalid_request(llm):
    with pytest.raises(InvalidRequestError, match="the regex cannot be compiled"):
        llm.engine.grammars.check(SamplingParams(regex="(unclosed"), timeout_s=10.0)
