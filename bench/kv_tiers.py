"""KV tiers below the pool (docs/kv_cache.md): kaon with a host-memory tier against kaon without,
and against kaon with a pool large enough for everything (the ceiling), in one run.

    python bench/kv_tiers.py [--pool-blocks 64] [--docs 16] [--doc-tokens 256] [--fits-docs 2]

1. A working set larger than the pool: --docs conversations, each a document of about --doc-tokens
   tokens and a question (together 4x the pool by default); every conversation's first turn, then
   every second turn (the first turn, its answer, a new question), so each returns after the
   others pushed it out of the pool. Sequential requests through the OpenAI client, streamed.
   Per server: the second turns' cached share (usage.prompt_tokens_details.cached_tokens over their
   prompt tokens) and their TTFT p50; the tier's share against the unbounded pool's and its TTFT
   against no tier's, as ratios. The second turns' greedy answers are compared between servers.
2. A working set that fits the pool (--fits-docs conversations, 4 clients at once): requests/s with
   and without the tier (the tier must not slow the common case; LMCache's users report it does).
   Both servers run at once here and take turns, --fits-rounds bursts each in alternating order, so
   that a change in the machine's load (it may be shared) hits both alike; the ratio is the median of
   the rounds' ratios.

Each server is a real `kaon serve` on CPU, started in turn (one engine at a time).
"""
from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from openai import OpenAI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from serve import free_port, start_kaon_with, wait_ready  # noqa: E402  (bench/serve.py: the same start-up)

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
         "romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def document(i: int, tokens: int) -> str:
    """About `tokens` tokens of text of its own (each document differs from its first words)."""
    words = [f"{WORDS[(i * 7 + j) % len(WORDS)]}{(i * 31 + j) % 97}" for j in range(tokens // 3)]
    return f"Document {i}: " + " ".join(words)


def turn(client: OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, float, int, int]:
    """(answer, TTFT, prompt tokens, cached tokens) of one streamed greedy chat request."""
    start = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            ttft = ttft if ttft is not None else time.perf_counter() - start
            parts.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    details = getattr(usage, "prompt_tokens_details", None)
    cached = (details.cached_tokens or 0) if details is not None else 0
    return "".join(parts), ttft if ttft is not None else time.perf_counter() - start, usage.prompt_tokens, cached


def conversations(client: OpenAI, docs: int, doc_tokens: int, firsts: list | None = None) -> dict:
    """Every first turn (unless given: a restarted server asked only the second turns), then every second turn."""
    if firsts is None:
        firsts = []
        for i in range(docs):
            messages = [{"role": "user", "content": document(i, doc_tokens) + "\nWhat is the first word?"}]
            answer, *_ = turn(client, messages, 8)
            firsts.append(messages + [{"role": "assistant", "content": answer}])
    ttfts, prompt, cached, answers = [], 0, 0, []
    for messages in firsts:  # each returns after all the others
        answer, ttft, p, c = turn(client, messages + [{"role": "user", "content": "And the last word?"}], 8)
        ttfts.append(ttft)
        prompt, cached = prompt + p, cached + c
        answers.append(answer)
    return {"cached_share": cached / prompt, "ttft_p50": statistics.median(ttfts), "answers": answers,
            "prompt_tokens": prompt, "firsts": firsts}


def fits_throughput(client: OpenAI, docs: int, doc_tokens: int, requests: int) -> float:
    """Requests/s of 4 clients asking about a few documents over and over (all fit the pool)."""
    def one(k: int) -> None:
        i = k % docs
        turn(client, [{"role": "user", "content": document(1000 + i, doc_tokens) + f"\nQuestion {k}?"}], 16)

    for k in range(docs):  # warm: the documents are in the pool before the clock starts
        one(k)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(one, range(requests)))
    return requests / (time.perf_counter() - start)


def fits_ratio(pool: list[str], tiers: list[str], args, log_dir: Path) -> float:
    """Tiered over untiered requests/s on a working set that fits the pool: both servers up at once,
    alternating bursts; the median of the rounds' ratios."""
    ports = [free_port(), free_port()]
    procs = [start_kaon_with(port, log_dir / f"fits-{i}.log", ["--device", "cpu", "--served-model-name", "m",
                                                               *pool, *(tiers if i else [])])
             for i, port in enumerate(ports)]
    try:
        for port, proc in zip(ports, procs):
            wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=300)
        clients = [OpenAI(base_url=f"http://127.0.0.1:{p}/v1", api_key="none", timeout=600) for p in ports]
        for client in clients:
            fits_throughput(client, args.fits_docs, args.doc_tokens, 4)  # warm
        ratios = []
        for r in range(args.fits_rounds):
            order = (0, 1) if r % 2 == 0 else (1, 0)
            rps = {i: fits_throughput(clients[i], args.fits_docs, args.doc_tokens, args.fits_requests) for i in order}
            ratios.append(rps[1] / rps[0])
            print(f"  fits round {r}: no tier {rps[0]:.2f} req/s, tiered {rps[1]:.2f} req/s ({ratios[-1]:.3f})",
                  flush=True)
        return statistics.median(ratios)
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()


def run_server(name: str, extra: list[str], args, log_dir: Path, firsts: list | None = None) -> dict:
    port = free_port()
    log = log_dir / f"{name}.log"
    proc = start_kaon_with(port, log, ["--device", "cpu", "--served-model-name", "m", *extra])
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=300)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        result = conversations(client, args.docs, args.doc_tokens, firsts)
        print(f"{name:>10}: second-turn cached share {result['cached_share']:.1%}, TTFT p50 "
              f"{result['ttft_p50'] * 1000:.0f} ms", flush=True)
        return result
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool-blocks", type=int, default=64)
    parser.add_argument("--docs", type=int, default=16)
    parser.add_argument("--doc-tokens", type=int, default=256)
    parser.add_argument("--fits-docs", type=int, default=2)
    parser.add_argument("--fits-requests", type=int, default=12, help="requests per burst")
    parser.add_argument("--fits-rounds", type=int, default=6)
    parser.add_argument("--skip-fits", action="store_true")
    parser.add_argument("--skip-conversations", action="store_true")
    parser.add_argument("--host-bytes", type=int, default=128 << 20, help="the host tier (about 180 blocks)")
    parser.add_argument("--disk-bytes", type=int, default=1 << 30, help="the disk tier below it")
    args = parser.parse_args()
    pool = ["--num-kv-blocks", str(args.pool_blocks)]
    same = True
    with tempfile.TemporaryDirectory() as log_dir:
        tiers = ["--kv-offload-bytes", str(args.host_bytes), "--kv-offload-dir", str(Path(log_dir) / "kv-disk"),
                 "--kv-offload-dir-bytes", str(args.disk_bytes)]
        if not args.skip_conversations:
            results = {
                "no-tier": run_server("no-tier", pool, args, Path(log_dir)),
                "tiered": run_server("tiered", [*pool, *tiers], args, Path(log_dir)),
            }
            # A restarted engine on the same disk tier (an empty pool and host tier): the second turns only.
            results["restarted"] = run_server("restarted", [*pool, *tiers], args, Path(log_dir),
                                              firsts=results["tiered"]["firsts"])
            results |= {
                "unbounded": run_server("unbounded", ["--num-kv-blocks", str(args.pool_blocks * 16)], args,
                                        Path(log_dir)),
            }
            same = report(results, args)
        if not args.skip_fits:
            (Path(log_dir) / "kv-disk-fits").mkdir()
            ratio = fits_ratio(pool, [*tiers[:2], "--kv-offload-dir", str(Path(log_dir) / "kv-disk-fits"),
                                      *tiers[4:]], args, Path(log_dir))
            print(f"fits the pool, tiered / no tier requests/s (median of {args.fits_rounds} rounds): {ratio:.3f}")
    return 0 if same else 1


def report(results: dict, args) -> bool:
    base, tier, ceiling = results["no-tier"], results["tiered"], results["unbounded"]
    print(f"\nworking set: the second turns' prompts, {base['prompt_tokens'] / 16 / args.pool_blocks:.1f}x the pool "
          f"of {args.pool_blocks} blocks")
    print(f"cached share, tiered / unbounded pool: {tier['cached_share'] / max(ceiling['cached_share'], 1e-9):.2f} "
          f"(no tier: {base['cached_share']:.1%})")
    print(f"TTFT p50, no tier / tiered: {base['ttft_p50'] / tier['ttft_p50']:.2f}x")
    again = results["restarted"]
    print(f"restarted on the disk tier: second-turn cached share {again['cached_share']:.1%}, TTFT p50 no tier / "
          f"restarted {base['ttft_p50'] / again['ttft_p50']:.2f}x; answers differing from the tiered run's: "
          f"{sum(x != y for x, y in zip(again['answers'], tier['answers']))}")
    def differ(a: dict, b: dict) -> int:
        return sum(x != y for x, y in zip(a["answers"], b["answers"]))

    # The tier gives back the very bytes the pool evicted: its answers are the unbounded pool's. Without a
    # tier the prefix is computed again, in other chunks than the cached run's, and float32 sums in another
    # order may flip a near tie (prefix caching's own effect, not the tier's; vLLM documents the same).
    print(f"greedy second-turn answers that differ: tiered vs unbounded pool {differ(tier, ceiling)}, "
          f"tiered vs no tier {differ(tier, base)}, unbounded vs no tier {differ(ceiling, base)} "
          f"(of {len(tier['answers'])})", flush=True)
    return differ(tier, ceiling) == 0


if __name__ == "__main__":
    raise SystemExit(main())
