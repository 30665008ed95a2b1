"""A grammar compile that can be stopped: xgrammar's compile in a forked child, killed at its deadline.

xgrammar cannot cancel a compile and Python cannot stop a thread, so a compile run on a thread past its
deadline kept that thread and its CPU until it finished (minutes for a costly grammar) long after its
request was answered, and a client sending such grammars piled them up. A child process can be killed:
its CPU and threads go with it.

The child is forked, not spawned: it starts at once and shares the parent's memory (xgrammar imports torch:
a spawned compile process would hold some 600 MB of its own), builds a compiler from the parent's
TokenizerInfo (plain data; the parent's compiler is not used, its thread pool does not exist in the child),
compiles, writes the compiled grammar's JSON (xgrammar's own serialization) or the compiler's error to a
pipe, and leaves with os._exit, running none of the parent's cleanup. It touches no torch, CUDA or lock of
the engine's; should it hang on something another thread held at the fork, its deadline kills it all the same.
"""
from __future__ import annotations

import json
import os
import select
import signal
import time

import xgrammar as xgr

READ_CHUNK = 1 << 20


def compile_spec(compiler: xgr.GrammarCompiler, kind: str, source: str) -> xgr.CompiledGrammar | None:
    """`source` of this kind compiled (None: an unknown kind); raises what xgrammar raises."""
    if kind == "json_schema":
        # Compact JSON (no free whitespace): a small model left free to emit whitespace can
        # emit it until max_tokens; the text is the same JSON either way.
        return compiler.compile_json_schema(source, any_whitespace=False)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(source)
    if kind == "choice":
        return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(o) for o in json.loads(source)))
    if kind == "grammar":
        return compiler.compile_grammar(source)
    if kind == "structural_tag":
        return compiler.compile_structural_tag(source)
    return None


class CompileTimeout(Exception):
    """The compile ran past its deadline; its process was killed."""


class CompileFailed(Exception):
    """The compiler refused the grammar (the message is its error), or its process ended without an answer."""


def compile_apart(info: xgr.TokenizerInfo, kind: str, source: str, timeout_s: float) -> xgr.CompiledGrammar:
    """`source` compiled in a forked child, which is killed if it has not answered within `timeout_s`;
    raises CompileTimeout or CompileFailed."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover -- the child: its coverage is its answer, read below
        os.close(read_fd)
        _answer(write_fd, info, kind, source)
    os.close(write_fd)
    try:
        data = _read_all(read_fd, time.monotonic() + timeout_s)
    except CompileTimeout:
        os.kill(pid, signal.SIGKILL)  # the point of the child: its CPU and threads stop here
        raise
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if not data:
        raise CompileFailed(f"the compile process ended without an answer (wait status {status})")
    reply = json.loads(data)
    if "grammar" not in reply:
        raise CompileFailed(reply["error"])
    return xgr.CompiledGrammar.deserialize_json(reply["grammar"], info)


def _answer(fd: int, info: xgr.TokenizerInfo, kind: str, source: str) -> None:  # pragma: no cover -- the child
    try:
        compiled = compile_spec(xgr.GrammarCompiler(info, max_threads=4, cache_enabled=False), kind, source)
        reply = {"grammar": compiled.serialize_json()} if compiled is not None else \
            {"error": f"unknown grammar kind {kind!r}"}
    except BaseException as exc:  # noqa: BLE001 -- the parent turns the compiler's words into the request's 400
        reply = {"error": (str(exc).strip() or type(exc).__name__).splitlines()[0]}
    try:
        view = memoryview(json.dumps(reply).encode())
        while view:
            view = view[os.write(fd, view):]
    finally:
        os._exit(0)


def _read_all(fd: int, deadline: float) -> bytes:
    chunks: list[bytes] = []
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            raise CompileTimeout()
        chunk = os.read(fd, READ_CHUNK)
        if not chunk:  # the child closed its end: it answered, or died
            return b"".join(chunks)
        chunks.append(chunk)
