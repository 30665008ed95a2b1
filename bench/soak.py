"""Soak test: kaon serve under about twice its sustainable load for a fixed time.

    python bench/soak.py [--minutes 10] [--rate 3] [--max-queue 32]

Poisson arrivals of streamed and non-streamed completions (a mix, some with a client that
hangs up early). Passes when: every answer is a success, a 429 (queue full) or a 503
(draining), no connection fails, no request hangs past its timeout, the server's RSS
stays flat (last minute vs first minute), and KV usage and the running/waiting gauges
are back to 0 at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import random
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve import MODEL, ROOT, free_port, load_checkpoint, make_requests, resolve_model, start_kaon_with, wait_ready

REQUEST_TIMEOUT = 300.0


async def one(client, url, prompt, max_tokens, stream, hang_up, counts):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.7,
            "stream": stream}
    try:
        if stream:
            async with client.stream("POST", url, json=body, timeout=REQUEST_TIMEOUT) as response:
                counts[response.status_code] += 1
                seen = 0
                async for _ in response.aiter_lines():
                    seen += 1
                    if hang_up and seen > 3:
                        counts["hung up early"] += 1
                        return
        else:
            response = await client.post(url, json=body, timeout=REQUEST_TIMEOUT)
            counts[response.status_code] += 1
    except httpx.TimeoutException:
        counts["timed out"] += 1
    except httpx.HTTPError as exc:
        counts[f"transport error {type(exc).__name__}"] += 1


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def gauge(metrics: str, name: str) -> float:
    match = re.search(rf"^{name} ([0-9.e+-]+)$", metrics, re.M)
    return float(match.group(1)) if match else float("nan")


async def soak(base: str, pid: int, minutes: float, rate: float, requests, seed: int):
    rng = random.Random(seed)
    counts: collections.Counter = collections.Counter()
    rss: list[tuple[float, float]] = []
    url = f"{base}/v1/completions"
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=1000)) as client:
        tasks, start, next_sample = [], time.monotonic(), 0.0
        while (elapsed := time.monotonic() - start) < minutes * 60:
            prompt, max_tokens = rng.choice(requests)
            tasks.append(asyncio.create_task(
                one(client, url, prompt, max_tokens, rng.random() < 0.7, rng.random() < 0.1, counts)))
            if elapsed >= next_sample:
                rss.append((elapsed, rss_mib(pid)))
                next_sample += 10
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
        await asyncio.sleep(1)
        metrics = (await client.get(f"{base}/metrics")).text
    return counts, rss, len(tasks), metrics


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second")
    parser.add_argument("--max-queue", type=int, default=32)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    tokenizer = load_checkpoint(resolve_model(MODEL)).tokenizer
    requests = make_requests(tokenizer, 200, args.seed)
    port = free_port()
    log = ROOT / "bench" / "out" / "soak_server.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = start_kaon_with(port, log, ["--max-queue", str(args.max_queue)])
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/ready", proc)
        counts, rss, sent, metrics = asyncio.run(soak(base, proc.pid, args.minutes, args.rate, requests, args.seed))
    finally:
        proc.terminate()
        proc.wait(timeout=120)
    first = [m for t, m in rss if t < 60]
    last = [m for t, m in rss if t >= args.minutes * 60 - 60]
    # Under overload the only acceptable answers are success, 429 (queue full) and 503 (draining).
    unexpected = {k: v for k, v in counts.items() if isinstance(k, int) and k not in (200, 429, 503)}
    leftovers = {name: gauge(metrics, name) for name in
                 ("kaon_kv_cache_usage_ratio", "kaon_num_requests_running", "kaon_num_requests_waiting")}
    print(f"soak: {args.minutes} min at {args.rate} req/s, {sent} requests, max queue {args.max_queue}")
    print("outcomes:", dict(sorted(counts.items(), key=str)))
    print(f"server RSS MiB: first minute max {max(first):.0f}, last minute max {max(last):.0f}")
    print("after the run:", leftovers)
    print(f"exit code on SIGTERM: {proc.returncode}")
    print(f"served: {counts[200] / (args.minutes * 60):.2f} req/s of {args.rate} offered")
    transport_errors = sum(v for k, v in counts.items() if str(k).startswith("transport error"))
    passed = (counts[200] > 0 and not unexpected and not transport_errors and not counts["timed out"]
              and all(v == 0 for v in leftovers.values()) and max(last) < max(first) * 1.15 and proc.returncode == 0)
    print("PASS" if passed else "FAIL")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
