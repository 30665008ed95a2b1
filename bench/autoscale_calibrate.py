"""Calibration of the autoscaling simulator's engine model from a real `kaon serve` here.

Run through `python bench/autoscale_sim.py --calibrate`. One server at a time (the machine
is shared), about two to four minutes of wall time:

- cold start: from process start to /ready answering 200 (import, weight load, warm-up);
- decode step time per batch size B: B concurrent streamed requests with a short prompt and
  a fixed number of output tokens (ignore_eos); while all B decode together every stream
  event is one engine step, so the median time between events is the step time at batch B;
- prefill cost per token: one request at a time, prompts of several lengths, max_tokens 1,
  so the request's latency is one prefill step (two above the 1024-token chunk budget);
  the slope of latency over prompt tokens is the cost of a prefill token (prefix caching off,
  so every repeat prefills in full).
The machine is shared (other people's tests and builds): of repeated measurements the low
quantile is kept, since contention only ever adds time.

The fit is step(batch, prefill_tokens) = a + b * batch + c * prefill_tokens (seconds): a and
b by least squares over the decode points, c as the slope of the prefill points.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import serve  # noqa: E402  (start_kaon_with, wait_ready, free_port)

BATCHES = (1, 2, 4, 8, 16, 32, 64)
PROMPT_LENGTHS = (64, 256, 512, 1024)
DECODE_TOKENS = 32
WORD = " river"  # one token in SmolLM2's vocabulary; prompts are this word repeated


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


async def _stream_gaps(client: httpx.AsyncClient, url: str, tokens: int) -> list[float]:
    """Times between the stream's events of one request (one event per engine step)."""
    body = {"model": serve.MODEL, "prompt": "Once upon a time," * 2, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", url, json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def decode_step(base: str, batch: int) -> float:
    """Median time between stream events while `batch` requests decode together."""
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch + 4)) as client:
        gaps = await asyncio.gather(*(_stream_gaps(client, f"{base}/v1/completions", DECODE_TOKENS)
                                      for _ in range(batch)))
    # Leave out the first gaps of each stream: the others' prefills may still share those steps.
    # The machine is shared: other processes stretch some steps, never shorten one, so a low
    # quantile of the gaps is the engine's own step time.
    return low_quantile([g for stream in gaps for g in stream[4:]])


def low_quantile(values: list[float], q: float = 0.25) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def prefill_latency(base: str, words: int) -> tuple[int, float]:
    """(prompt tokens, seconds) of a one-token completion of a prompt of `words` words."""
    body = {"model": serve.MODEL, "prompt": WORD * words, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
    times, tokens = [], 0
    for _ in range(4):  # the server runs without prefix caching, so every repeat prefills in full
        start = time.perf_counter()
        response = httpx.post(f"{base}/v1/completions", json=body, timeout=600)
        times.append(time.perf_counter() - start)
        tokens = response.json()["usage"]["prompt_tokens"]
    return tokens, low_quantile(times)


def calibrate(out: Path) -> dict:
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    port = serve.free_port()
    base = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = serve.start_kaon_with(port, logs / "autoscale_calibrate.log", ["--no-enable-prefix-caching"])
    try:
        serve.wait_ready(f"{base}/ready", proc)
        cold_start = time.perf_counter() - started
        asyncio.run(decode_step(base, 2))  # warm-up
        decode = {b: asyncio.run(decode_step(base, b)) for b in BATCHES}
        prefill = [prefill_latency(base, n) for n in PROMPT_LENGTHS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    a, b = linear_fit([float(k) for k in decode], list(decode.values()))
    # Prompts within one 1024-token chunk are one step: latency = a + b + c * tokens (+ HTTP).
    one_chunk = [(t, s) for t, s in prefill if t <= 1024]
    _, c = linear_fit([float(t) for t, _ in one_chunk], [s for _, s in one_chunk])
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores; load average {load_before:.1f} when calibration started",
        "model": serve.MODEL, "max_num_seqs": 64, "max_num_batched_tokens": 1024,
        "step_ms": [round(a * 1e3, 3), round(b * 1e3, 4), round(c * 1e3, 5)],
        "cold_start_s": round(cold_start, 2),
        "measured": {"decode_step_ms": {str(k): round(v * 1e3, 2) for k, v in decode.items()},
                     "prefill_latency_ms": {str(t): round(s * 1e3, 1) for t, s in prefill}},
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    print(json.dumps(calibrate(ROOT / "bench" / "data" / "autoscale_calibration.json"), indent=2))
