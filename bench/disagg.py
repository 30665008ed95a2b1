"""Prefill/decode disaggregation against one aggregated engine, on this machine's two cores (docs/disaggregation.md).

    python bench/disagg.py [--seconds 60] [--streams 4] [--long-tokens 1500] [--long-every 4[,12,30]]
                           [--omp-wait-policy passive] [--prefill-chunk-tokens N]

In one run, with the bundled model:
- disaggregated: a prefill engine pinned to core 0 (taskset) and a decode engine pinned to core 1, one thread each;
- aggregated: one engine on both cores, two threads.
Each gets the same mixed load for --seconds: --streams clients each stream short prompts back to back (the
decoding streams), while a long prompt (--long-tokens, never cached) arrives every --long-every seconds.
Printed: inter-token latency p50/p99 of the decoding streams, time to first token p50 of the long prompts and of
the short ones, output tokens/s, and their ratios (disaggregated over aggregated); then the transfer alone (a
prompt the prefill engine holds in its cache, so the time is the K/V's move) per 1,000 tokens; then time to
first token of one prompt on an idle pair against an idle engine by prompt length (where disaggregation
starts to pay for a single request).

Goals (issue 50): ITL p99 >= 3x lower, TTFT p50 <= 1.2x, output tokens/s >= 0.9x of the aggregated engine.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from sse import text_arrivals  # bench/sse.py: this script's folder is on sys.path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "builtin://smollm2-135m-instruct"
STALL_S = 0.5  # an inter-token gap this long is a stall (a prefill step), not decoding
WORDS = ("cluster node pod engine token cache block prefill decode stream latency replica service router "
         "queue batch kernel tensor layer model").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Engine:
    proc: subprocess.Popen
    url: str


def start(cpus: str, *args: str, env: dict[str, str] | None = None) -> Engine:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": str(len(cpus.split(","))),
           "PYTHONPATH": f"{ROOT / 'runtime'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", **(env or {})}
    proc = subprocess.Popen(["taskset", "-c", cpus, sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL,
                             "--port", str(port), "--device", "cpu", "--log-level", "warning", *args],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    return Engine(proc, f"http://127.0.0.1:{port}")


async def wait_ready(session: aiohttp.ClientSession, engines: list[Engine]) -> None:
    for engine in engines:
        while True:
            if engine.proc.poll() is not None:
                raise SystemExit(f"engine exited: {engine.proc.stderr.read() if engine.proc.stderr else ''}")
            try:
                async with session.get(engine.url + "/ready") as r:
                    if r.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)


def stop(engines: list[Engine]) -> None:
    for engine in engines:
        engine.proc.terminate()
    for engine in engines:
        try:
            engine.proc.wait(30)
        except subprocess.TimeoutExpired:
            engine.proc.kill()


def text(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


@dataclass
class Stats:
    itl: list[float] = field(default_factory=list)  # gaps between tokens of the decoding streams
    ttft_long: list[float] = field(default_factory=list)
    ttft_short: list[float] = field(default_factory=list)
    tokens: int = 0
    failed: int = 0


async def complete(session, url: str, prompt: str, max_tokens: int, stats: Stats, long: bool) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    start_t, last = time.perf_counter(), None
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                stats.failed += 1
                return
            async for now in text_arrivals(r):
                if last is None:
                    (stats.ttft_long if long else stats.ttft_short).append(now - start_t)
                elif not long:
                    stats.itl.append(now - last)
                last = now
                stats.tokens += 1
    except aiohttp.ClientError:
        stats.failed += 1


async def mixed_load(url: str, seconds: float, streams: int, long_tokens: int, long_every: float,
                     seed: int) -> tuple[Stats, float]:
    stats, rng = Stats(), random.Random(seed)
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def stream_loop(i: int) -> None:
            n = 0
            while time.perf_counter() < deadline:
                await complete(session, url, f"Stream {i}.{n}: " + text(20, rng), 48, stats, long=False)
                n += 1

        async def long_loop() -> None:
            tasks, n = [], 0
            while time.perf_counter() < deadline:
                # A unique head: nothing of it is in any prefix cache.
                prompt = f"Document {seed}-{n}: " + text(int(long_tokens / 1.3), rng)
                tasks.append(asyncio.create_task(complete(session, url, prompt, 16, stats, long=True)))
                n += 1
                await asyncio.sleep(long_every)
            await asyncio.gather(*tasks)

        began = time.perf_counter()
        await asyncio.gather(long_loop(), *(stream_loop(i) for i in range(streams)))
        return stats, time.perf_counter() - began


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def ttft_alone(url: str, words: int, seed: int) -> float:
    rng = random.Random(seed)
    stats = Stats()
    async with aiohttp.ClientSession() as session:
        for i in range(3):
            await complete(session, url, f"Alone {seed}-{i}: " + text(words, rng), 1, stats, long=True)
    return statistics.median(stats.ttft_long)


async def transfer_per_1000(prefill_url: str, tokens: int) -> list[tuple[float, float]]:
    """[(ask to first chunk, first chunk to done)] seconds per 1,000 tokens, cold then cached on the prefill engine,
    asking it directly over TCP: the first phase is the prefill engine's queue and prefill (cached: one step for
    the last partial block), the second the K/V's move (the prompt is one chunk when it fits one step)."""
    from kaon_runtime.engine.kv_wire import KvAssembler, TcpTransport

    class Timed(KvAssembler):
        first_chunk_at: float | None = None

        def destination(self, header: dict):
            if self.first_chunk_at is None and header.get("type") == "chunk":
                self.first_chunk_at = time.perf_counter()
            return super().destination(header)

    rng = random.Random(7)
    token_ids = [rng.randrange(1000, 40000) for _ in range(tokens)]
    transport, layout, times = TcpTransport(), await _layout(prefill_url), []
    per_1000 = 1000 / (tokens - 1)
    try:
        for _ in range(2):  # the second time the prefill engine holds the prompt in its prefix cache
            ask = {"token_ids": token_ids, "start": 0, "adapter": None, "cache_salt": None}
            assembler = Timed(layout, 0, tokens - 1)
            began = time.perf_counter()
            await transport._stream(prefill_url, ask, assembler, 600)
            ended, first = time.perf_counter(), assembler.first_chunk_at or began
            times.append(((first - began) * per_1000, (ended - first) * per_1000))
    finally:
        await transport.close()
    return times


async def _layout(prefill_url: str):
    from kaon_runtime.engine.kv_transfer import KvLayout
    from kaon_runtime.engine.kv_wire import PREFILL_PATH, FrameReader

    async with aiohttp.ClientSession() as session, session.post(
            prefill_url + PREFILL_PATH, json={"token_ids": [1, 2], "start": 0}) as r:
        reader = FrameReader()
        async for data in r.content.iter_any():
            for header, _ in reader.feed(data):
                if header["type"] == "meta":
                    return KvLayout(**header["layout"])
    raise SystemExit("no meta frame")


async def run(args) -> None:
    results: dict[str, dict] = {}  # setup -> {"alone": {tokens: s}, rate: (Stats, seconds)}
    lengths = [int(x) for x in args.alone_tokens.split(",")]
    rates = [float(x) for x in str(args.long_every).split(",")]
    env = {"OMP_WAIT_POLICY": args.omp_wait_policy} if args.omp_wait_policy else {}
    chunk = ("--disagg-chunk-tokens", str(args.prefill_chunk_tokens)) if args.prefill_chunk_tokens else ()
    async with aiohttp.ClientSession() as session:
        # Disaggregated: prefill on core 0, decode on core 1.
        prefill = start("0", "--role", "prefill", *chunk, env=env)
        decode = start("1", "--role", "decode", "--prefill-url", prefill.url,
                       "--disagg-min-prompt-tokens", str(args.min_prompt_tokens), "--kv-transport", args.kv_transport,
                       env=env)
        try:
            await wait_ready(session, [prefill, decode])
            results["disaggregated"] = await one_setup(decode.url, args, lengths, rates)
            transfer = await transfer_per_1000(prefill.url, args.transfer_tokens)
            async with session.get(decode.url + "/metrics") as r:
                metrics = [m for m in (await r.text()).splitlines() if m.startswith("kaon_kv_transfer")
                           and ("tokens_total" in m or "fallbacks_total" in m or "seconds_sum" in m
                                or "seconds_count" in m)]
        finally:
            stop([prefill, decode])
        aggregated = start("0,1", env=env)
        try:
            await wait_ready(session, [aggregated])
            results["aggregated"] = await one_setup(aggregated.url, args, lengths, rates)
        finally:
            stop([aggregated])
    report(args, results, rates, transfer, metrics)


async def one_setup(url: str, args, lengths: list[int], rates: list[float]) -> dict:
    """One setup's figures: one prompt alone by length, then the mixed load at each long-prompt rate."""
    out: dict = {"alone": {n: await ttft_alone(url, int(n / 1.3), 100 + n) for n in lengths}}
    for i, every in enumerate(rates):
        out[every] = await mixed_load(url, args.seconds, args.streams, args.long_tokens, every, 1 + i)
    return out


def report(args, results, rates: list[float], transfer: list[tuple[float, float]], metrics: list[str]) -> None:
    print(f"bench/disagg.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  load average "
          f"{os.getloadavg()[0]:.1f} (the machine is shared with other work)")
    print(f"decode engine's K/V transport: {args.kv_transport}; OMP_WAIT_POLICY "
          f"{args.omp_wait_policy or '(unset)'}; prefill engine's chunk "
          f"{args.prefill_chunk_tokens or '(its default)'} tokens")
    for every in rates:
        print(f"mixed load: {args.streams} decoding streams (48 tokens each, back to back) + a "
              f"{args.long_tokens}-token prompt every {every:g} s, for {args.seconds:g} s")
        rows = {}
        for name in ("disaggregated", "aggregated"):
            stats, seconds = results[name][every]
            rows[name] = (pct(stats.itl, 0.5), pct(stats.itl, 0.99), pct(stats.ttft_long, 0.5),
                          pct(stats.ttft_short, 0.5), stats.tokens / seconds, stats.failed, len(stats.ttft_long))
            print(f"  {name:14s} ITL p50 {rows[name][0] * 1000:7.1f} ms  p99 {rows[name][1] * 1000:7.1f} ms  "
                  f"TTFT p50 long {rows[name][2]:6.2f} s  short {rows[name][3]:6.2f} s  "
                  f"output {rows[name][4]:6.1f} tok/s  long prompts {rows[name][6]}  failed {rows[name][5]}")
            # A long prompt's prefill stalls every stream once: 4 gaps per long prompt among thousands, under 1% of
            # them at --long-every 12, so p99 can miss the stalls altogether; these show them.
            stalls = [gap for gap in stats.itl if gap > STALL_S]
            worst = max(stats.itl, default=0.0)
            print(f"  {'':14s} ITL p99.9 {pct(stats.itl, 0.999) * 1000:7.1f} ms  max {worst * 1000:7.1f} ms  gaps "
                  f"over {STALL_S * 1000:.0f} ms: {len(stalls)} of {len(stats.itl)} ({sum(stalls):.1f} s in all)")
        d, a = rows["disaggregated"], rows["aggregated"]
        print(f"  ratios at one long prompt every {every:g} s (disaggregated / aggregated): ITL p99 {d[1] / a[1]:.2f}x "
              f"(goal <= 0.33x), TTFT p50 long {d[2] / a[2]:.2f}x (goal <= 1.2x), short {d[3] / a[3]:.2f}x, "
              f"output tok/s {d[4] / a[4]:.2f}x (goal >= 0.9x)")
    (cold_prefill, cold_move), (cached_prefill, cached_move) = transfer
    print(f"transfer of {args.transfer_tokens} tokens over TCP, per 1,000 tokens: cold: ask to first chunk (the "
          f"prefill's first chunk) {cold_prefill * 1000:.0f} ms, then to the last byte {cold_move * 1000:.0f} ms (the "
          f"rest of the prefill, the moves overlapping it); cached on the prefill engine: ask to first chunk "
          f"{cached_prefill * 1000:.0f} ms, then the move {cached_move * 1000:.0f} ms")
    print("one prompt alone, TTFT p50 (disaggregated vs aggregated):")
    for n in results["aggregated"]["alone"]:
        dn, an = results["disaggregated"]["alone"][n], results["aggregated"]["alone"][n]
        print(f"  ~{n:5d} tokens: {dn:6.3f} s vs {an:6.3f} s  ({dn / an:.2f}x)")
    print("decode engine's transfer metrics:\n  " + "\n  ".join(metrics))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--long-every", default="4",
                        help="seconds between long prompts; a comma-separated list runs the mixed load at each rate "
                        "on the same engines (where disaggregation starts to pay)")
    parser.add_argument("--omp-wait-policy", choices=("passive", "active"), default=None,
                        help="OMP_WAIT_POLICY for every engine (passive: libgomp's threads sleep at barriers rather "
                        "than spin; unset: libgomp's default)")
    parser.add_argument("--prefill-chunk-tokens", type=int, default=None,
                        help="the prefill engine's --disagg-chunk-tokens (unset: its default)")
    parser.add_argument("--min-prompt-tokens", type=int, default=64, help="the decode engine's threshold")
    parser.add_argument("--transfer-tokens", type=int, default=1001)
    parser.add_argument("--kv-transport", choices=("auto", "nixl", "tcp"), default="auto",
                        help="the decode engine's (the transfer-alone figure is always over TCP)")
    parser.add_argument("--alone-tokens", default="128,512,2048")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
