"""The engine's performance profile, measured on a real `kaon serve` here: the autoscaling
simulator's engine model and the predictive autoscaler's performance model (one JSON, the
`perf_model.PerfModel` the operator reads from a ConfigMap).

    python bench/autoscale_calibrate.py [--out FILE] [--quantization Q] [--profile-out FILE]
    python bench/autoscale_sim.py --calibrate

One server at a time (the machine is shared), a few minutes of wall time:

- cold start: from process start to /ready answering 200 (import, weight load, warm-up);
- decode step time over a grid of batch size B and context length L: B concurrent streamed
  requests with an L-token prompt and a fixed number of output tokens (ignore_eos); once
  every prompt is prefilled, all B decode together and every stream event is one engine
  step, so a low quantile of the times between events is the step time at (B, B x L);
- prefill cost per token: one request at a time, prompts of several lengths, max_tokens 1,
  so the request's latency is one prefill step (two above the 1024-token chunk budget);
  the slope of latency over prompt tokens is the cost of a prefill token (prefix caching off,
  so every repeat prefills in full).
The machine is shared (other people's tests and builds): of repeated measurements the low
quantile is kept, since contention only ever adds time.

The fit (`perf_model.fit`, least squares over every point) is step(batch, prefill tokens,
context tokens) = a + b * batch + c * prefill tokens + d * context tokens (seconds).
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

sys.path.insert(0, str(ROOT / "operator"))

import serve  # noqa: E402  (start_kaon_with, wait_ready, free_port)

from kaon_operator import perf_model  # noqa: E402

BATCHES = (1, 2, 4, 8, 16, 32, 64)
LONG_CONTEXT = 384  # prompt tokens of the long-context decode points
LONG_CONTEXT_BATCHES = (1, 4, 16)  # prefilling 64 x 384 tokens first would take minutes on a CPU
SHORT_PROMPT = "Once upon a time," * 2  # 10 tokens
PROMPT_LENGTHS = (64, 256, 512, 1024)
DECODE_TOKENS = 32
WORD = " river"  # one token in SmolLM2's vocabulary; prompts are this word repeated


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) by least squares."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


async def _stream_gaps(client: httpx.AsyncClient, url: str, prompt: str, tokens: int) -> list[float]:
    """Times between the stream's events of one request (one event per engine step)."""
    body = {"model": serve.MODEL, "prompt": prompt, "max_tokens": tokens, "temperature": 0,
            "stream": True, "ignore_eos": True}
    stamps = []
    async with client.stream("POST", url, json=body, timeout=600) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in itertools.pairwise(stamps)]


async def decode_step(base: str, batch: int, context: int = 0) -> float:
    """A low quantile of the times between stream events while `batch` requests with
    `context`-token prompts decode together."""
    prompt = WORD * context if context else SHORT_PROMPT
    skip = 4 + batch * context // 1024  # the steps that may still prefill the others' prompts
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=batch + 4)) as client:
        gaps = await asyncio.gather(*(_stream_gaps(client, f"{base}/v1/completions", prompt, skip + DECODE_TOKENS)
                                      for _ in range(batch)))
    # The machine is shared: other processes stretch some steps, never shorten one, so a low
    # quantile of the gaps is the engine's own step time.
    return low_quantile([g for stream in gaps for g in stream[skip:]])


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


def calibrate(out: Path, quantization: str = "none") -> dict:
    """Profile the bundled model (serve.MODEL) with `quantization`; write the whole record to `out`."""
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)
    port = serve.free_port()
    base = f"http://127.0.0.1:{port}"
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    proc = serve.start_kaon_with(port, logs / "autoscale_calibrate.log",
                                 ["--no-enable-prefix-caching", "--quantization", quantization])
    try:
        serve.wait_ready(f"{base}/ready", proc)
        cold_start = time.perf_counter() - started
        asyncio.run(decode_step(base, 2))  # warm-up
        decode = {(b, 0): asyncio.run(decode_step(base, b)) for b in BATCHES}
        decode |= {(b, LONG_CONTEXT): asyncio.run(decode_step(base, b, LONG_CONTEXT)) for b in LONG_CONTEXT_BATCHES}
        prefill = [prefill_latency(base, n) for n in PROMPT_LENGTHS]
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    short = len(SHORT_PROMPT.split()) + 2  # about its tokens
    grid = [perf_model.GridPoint(b, 0, b * ((ctx or short) + DECODE_TOKENS / 2), s) for (b, ctx), s in decode.items()]
    # Prompts within one 1024-token chunk are one step: latency = a + c * tokens + d * tokens (+ HTTP).
    grid += [perf_model.GridPoint(0, t, t, s) for t, s in prefill if t <= 1024]
    a, b, c, d = perf_model.fit(grid)
    profile = perf_model.PerfModel(
        a=round(a, 6), b=round(b, 7), c=round(c, 8), d=round(d, 10), cold_start_seconds=round(cold_start, 2),
        max_num_seqs=64, max_num_batched_tokens=1024,
        key={"device": f"cpu ({os.cpu_count()} cores)", "model": serve.MODEL, "quantization": quantization},
        grid=tuple(perf_model.GridPoint(p.batch, p.prefill_tokens, p.context_tokens, round(p.seconds, 5))
                   for p in grid))
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{os.cpu_count()} CPU cores; load average {load_before:.1f} when calibration started",
        "model": serve.MODEL, "max_num_seqs": 64, "max_num_batched_tokens": 1024,
        "step_ms": [round(a * 1e3, 3), round(b * 1e3, 4), round(c * 1e3, 5), round(d * 1e3, 8)],
        "cold_start_s": round(cold_start, 2),
        "measured": {"decode_step_ms": {f"{b}x{ctx}": round(v * 1e3, 2) for (b, ctx), v in decode.items()},
                     "prefill_latency_ms": {str(t): round(s * 1e3, 1) for t, s in prefill}},
        "wall_s": round(time.perf_counter() - started, 1),
        "perf_model": json.loads(profile.to_json()),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "data" / "autoscale_calibration.json")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--profile-out", type=Path, help="also write the bare performance model (a ConfigMap's data)")
    args = parser.parse_args(argv)
    result = calibrate(args.out, args.quantization)
    if args.profile_out:
        args.profile_out.write_text(json.dumps(result["perf_model"], indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
