"""End to end through `kaon serve`: decode tokens/s of the same chat requests with and without
response_format json_schema, at a few batch sizes (bench/structured.py --serve runs it).

Each request streams a fixed number of tokens (ignore_eos, max_tokens) and is timed from its
first token to its last; a batch's rate is the sum of its requests' rates. The schema is one the
model cannot finish inside that length (an array of at least 32 strings of 8 characters or more),
so the constrained run decodes every token under a mask and none ends early; a request that
ends before max_tokens is reported. The best of the repeats each way, alternating which goes first.
"""
from __future__ import annotations

import asyncio
import json
import tempfile
import time
from pathlib import Path

import httpx

from tests.support.server import MODEL, Server

STORY = {"type": "object", "properties": {"paragraphs": {
    "type": "array", "items": {"type": "string", "minLength": 8}, "minItems": 32}},
    "required": ["paragraphs"], "additionalProperties": False}
PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm, as JSON."}]


async def one(client: httpx.AsyncClient, url: str, tokens: int, constrained: bool) -> tuple[int, float]:
    """(tokens streamed, decode tokens/s from the first token to the last)."""
    body = {"model": MODEL, "messages": PROMPT, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": STORY}}
    first = last = None
    count = 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                last = time.perf_counter()
                first = first or last
    return count, (count - 1) / (last - first) if first and last and last > first else 0.0


async def batch_rate(url: str, batch: int, tokens: int, constrained: bool) -> tuple[float, int]:
    """(decode tokens/s of the batch, requests that ended short of `tokens`)."""
    async with httpx.AsyncClient(timeout=600) as client:
        results = await asyncio.gather(*(one(client, url, tokens, constrained) for _ in range(batch)))
    return sum(rate for _, rate in results), sum(count != tokens for count, _ in results)


def serve_overhead(batches: list[int], tokens: int, repeats: int, device: str) -> list[dict]:
    extra = [] if device == "cpu" else ["--device", device, "--dtype", "auto"]
    server = Server(Path(tempfile.mkdtemp(prefix="kaon-structured-")), *extra)
    try:
        asyncio.run(batch_rate(server.url, 1, 4, constrained=True))  # compile the schema once, off the clock
        rows = []
        for batch in batches:
            best, short = {True: 0.0, False: 0.0}, 0
            for r in range(repeats):
                for constrained in ((True, False) if r % 2 == 0 else (False, True)):
                    rate, cut = asyncio.run(batch_rate(server.url, batch, tokens, constrained))
                    best[constrained], short = max(best[constrained], rate), short + cut
            rows.append({"batch": batch, "tokens": tokens, "tok_s_with": best[True], "tok_s_without": best[False],
                         "ratio": best[True] / best[False], "ended_short": short})
        return rows
    finally:
        server.stop()
