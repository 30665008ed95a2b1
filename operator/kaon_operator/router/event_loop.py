"""Which event loop the router runs on: uvloop's (libuv, in C) when it is installed, else asyncio's.

The router's data path is a few protocol callbacks and one coroutine per request; asyncio's own loop
(its selector, its Python-level transports) was about a sixth of the router's CPU per request
(py-spy at 64 clients, bench/router.py), and uvloop's did the same work in about 12% less CPU a request
on the quiet machine. uvloop is a dependency of the router's install (operator/pyproject.toml, so the
chart's image has it); `--event-loop asyncio` is the way back, and the only loop where uvloop is missing.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

CHOICES = ("auto", "uvloop", "asyncio")


class LoopUnavailable(Exception):
    """`--event-loop uvloop` on an install without uvloop."""


def loop_factory(choice: str = "auto") -> Callable[[], asyncio.AbstractEventLoop]:
    """The factory of the loop `choice` names: `auto` is uvloop's when it imports, else asyncio's."""
    if choice not in CHOICES:
        raise ValueError(f"unknown event loop {choice!r}: one of {', '.join(CHOICES)}")
    if choice == "asyncio":
        return asyncio.new_event_loop
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise LoopUnavailable("--event-loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return asyncio.new_event_loop
    return uvloop.new_event_loop
