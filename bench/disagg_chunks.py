"""A prefill engine's chunk size (`--disagg-chunk-tokens`): how much of a prompt's K/V move overlaps its prefill.

    python bench/disagg_chunks.py [--chunks 256,512,1024] [--tokens 1001] [--rounds 5] [--transport tcp,nixl]

For each chunk size, one `kaon serve --role prefill --disagg-chunk-tokens C` pinned to core 0 with one thread
(as bench/disagg.py runs it; all of them at once, asked in turn, so the machine's other load falls on each
alike), asked for a never-cached prompt's K/V by this process pinned to core 1 (where
bench/disagg.py's decode engine runs), through the decode engine's own client (engine/kv_wire.py: TCP, or NIXL
into a staging buffer). Per 1,000 tokens, medians over --rounds:
- total: the ask to the last byte in place (what a long prompt's time to first token waits for);
- prefill: the ask to the last chunk's header (the prefill engine sends each chunk once its step is done);
- tail: the last chunk's header to the last byte (the move left after the prefill, not overlapped);
- move: the same prompt asked again, now cached on the prefill engine (one step for the last partial block,
  then all of it in one chunk): the whole move with nothing to overlap;
- overlapped: 1 - tail / move, the share of the move hidden behind the prefill.
The ratio to print is total at each chunk size over total at 1,024 (one chunk: the move after the whole prefill).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import time

import aiohttp
from disagg import _layout, start, stop, wait_ready  # bench/disagg.py: this script's folder is on sys.path


async def one_ask(url: str, token_ids: list[int], layout, transport_name: str, transport) -> tuple[float, float]:
    """(ask to last chunk header, ask to done) seconds."""
    from kaon_runtime.engine.kv_wire import KvAssembler

    last_header: list[float] = []

    class Timed(KvAssembler):
        def add(self, header: dict, payload) -> None:
            if header.get("type") == "chunk" and header.get("placed"):
                last_header.append(time.perf_counter())  # NIXL: the header follows the WRITE
            super().add(header, payload)

        def destination(self, header: dict):
            if header.get("type") == "chunk":
                last_header.append(time.perf_counter())
            return super().destination(header)

    ask = {"token_ids": token_ids, "start": 0, "adapter": None, "cache_salt": None}
    end = len(token_ids) - 1
    began = time.perf_counter()
    if transport_name == "nixl":
        offset = transport.ranges.take(end)
        progress = asyncio.create_task(transport._progress())
        try:
            staging = transport.staging[offset:offset + end]
            ask |= {"nixl": {"agent": transport.agent_name, "metadata": transport.metadata, "addr": staging.data_ptr()}}
            await transport._stream(url, ask, Timed(layout, 0, end, staging), 600)
        finally:
            progress.cancel()
            transport.ranges.give(offset, end)
    else:
        await transport._stream(url, ask, Timed(layout, 0, end), 600)
    done = time.perf_counter()
    return last_header[-1] - began, done - began


async def one_round(url: str, token_ids: list[int], layout, name: str, transport) -> dict[str, float]:
    """One never-cached ask, then the same prompt again (cached): seconds per 1,000 tokens."""
    per_1000 = 1000 / (len(token_ids) - 1)
    last_header, total = await one_ask(url, token_ids, layout, name, transport)
    cached_header, cached_total = await one_ask(url, token_ids, layout, name, transport)
    return {"total": total * per_1000, "prefill": last_header * per_1000, "tail": (total - last_header) * per_1000,
            "move": (cached_total - cached_header) * per_1000}


async def run(args) -> None:
    from kaon_runtime.engine.kv_wire import NixlTransport, TcpTransport

    os.sched_setaffinity(0, {1})  # the decode engine's core in bench/disagg.py
    chunks, names = [int(c) for c in args.chunks.split(",")], args.transport.split(",")
    rounds: dict[tuple[str, int], list[dict[str, float]]] = {(n, c): [] for n in names for c in chunks}
    # Every chunk size's engine at once, all on core 0, asked in turn (only one computes at a time): the machine's
    # other load falls on every arm alike. A small pool each (--kv-cache-bytes) keeps them under a few GiB.
    engines = {c: start("0", "--role", "prefill", "--disagg-chunk-tokens", str(c), "--kv-cache-bytes", str(256 << 20))
               for c in chunks}
    transports: list = []
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, list(engines.values()))
        layout = await _layout(engines[chunks[0]].url)
        clients = {n: NixlTransport(lambda: None, layout, args.tokens) if n == "nixl" else TcpTransport()
                   for n in names}
        transports = list(clients.values())
        rng = random.Random(1)
        for r in range(args.rounds):
            for name in names:
                for chunk in chunks:
                    token_ids = [rng.randrange(1000, 40000) for _ in range(args.tokens)]
                    row = await one_round(engines[chunk].url, token_ids, layout, name, clients[name])
                    rounds[name, chunk].append(row)
                    print(f"  round {r} {name} chunk {chunk}: " + "  ".join(f"{k} {v * 1000:.0f} ms"
                                                                           for k, v in row.items()), flush=True)
    finally:
        for t in transports:
            await t.close()
        stop(list(engines.values()))
    print(f"bench/disagg_chunks.py  {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  load average "
          f"{os.getloadavg()[0]:.1f} (the machine is shared with other work)")
    print(f"a {args.tokens}-token prompt's K/V from a prefill engine on core 0 (1 thread), read on core 1; per 1,000 "
          f"tokens, medians of {args.rounds} rounds (the arms alternate within each round)")
    for name in names:
        med = {c: {k: statistics.median(row[k] for row in rounds[name, c]) for k in rounds[name, c][0]}
               for c in chunks}
        one_chunk = med[max(chunks)]["total"]
        for chunk, m in med.items():
            overlapped = max(0.0, 1 - m["tail"] / m["move"]) if m["move"] else float("nan")
            print(f"  {name:4s} chunk {chunk:5d}: total {m['total'] * 1000:6.0f} ms ({m['total'] / one_chunk:.2f}x "
                  f"chunk {max(chunks)})  prefill {m['prefill'] * 1000:6.0f} ms  tail {m['tail'] * 1000:5.0f} ms  "
                  f"move {m['move'] * 1000:5.0f} ms  overlapped {overlapped:.0%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--chunks", default="256,512,1024")
    parser.add_argument("--tokens", type=int, default=1001)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--transport", default="tcp,nixl", help="comma-separated: tcp, nixl")
    asyncio.run(run(parser.parse_args()))


if __name__ == "__main__":
    main()
