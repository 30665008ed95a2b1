"""A completion stream as its client sees it: when each piece of text arrives (shared by the benches that
time tokens from outside the engine: disagg.py, engine_contention.py)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator


async def text_arrivals(response) -> AsyncIterator[float]:
    """time.perf_counter() at each server-sent event of an aiohttp response that carries text; events with
    empty text (a role, a finish reason) and the closing [DONE] are passed over."""
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        if json.loads(line[6:])["choices"][0]["text"]:
            yield time.perf_counter()
