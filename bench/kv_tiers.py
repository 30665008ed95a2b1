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


def conversations(client: OpenAI, docs: int, doc_tokens: int) -> dict:
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
            "prompt_tokens": prompt}


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


def run_server(name: str, extra: list[str], args, log_dir: Path) -> dict:
    port = free_port()
    log = log_dir / f"{name}.log"
    proc = start_kaon_with(port, log, ["--device", "cpu", "--served-model-name", "m", *extra])
    try:
        wait_ready(f"http://127.0.0.1:{port}/health", proc, timeout=300)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=600)
        result = conversations(client, args.docs, args.doc_tokens)
        if name != "unbounded":
            result["fits_rps"] = fits_throughput(client, args.fits_docs, args.doc_tokens, args.fits_requests)
        print(f"{name:>10}: second-turn cached share {result['cached_share']:.1%}, TTFT p50 "
              f"{result['ttft_p50'] * 1000:.0f} ms" + (f", fits-the-pool {result['fits_rps']:.2f} req/s"
                                                       if "fits_rps" in result else ""), flush=True)
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
    parser.add_argument("--fits-requests", type=int, default=32)
    parser.add_argument("--host-bytes", type=int, default=128 << 20, help="the host tier (about 180 blocks)")
    parser.add_argument("--disk-bytes", type=int, default=1 << 30, help="the disk tier below it")
    args = parser.parse_args()
    pool = ["--num-kv-blocks", str(args.pool_blocks)]
    with tempfile.TemporaryDirectory() as log_dir:
        disk = Path(log_dir) / "kv-disk"
        results = {
            "no-tier": run_server("no-tier", pool, args, Path(log_dir)),
            "tiered": run_server("tiered", [*pool, "--kv-offload-bytes", str(args.host_bytes),
                                            "--kv-offload-dir", str(disk), "--kv-offload-dir-bytes",
                                            str(args.disk_bytes)], args, Path(log_dir)),
            "unbounded": run_server("unbounded", ["--num-kv-blocks", str(args.pool_blocks * 16)], args, Path(log_dir)),
        }
    base, tier, ceiling = results["no-tier"], results["tiered"], results["unbounded"]
    print(f"\nworking set: the second turns' prompts, {base['prompt_tokens'] / 16 / args.pool_blocks:.1f}x the pool "
          f"of {args.pool_blocks} blocks")
    print(f"cached share, tiered / unbounded pool: {tier['cached_share'] / max(ceiling['cached_share'], 1e-9):.2f} "
          f"(no tier: {base['cached_share']:.1%})")
    print(f"TTFT p50, no tier / tiered: {base['ttft_p50'] / tier['ttft_p50']:.2f}x")
    print(f"fits the pool, tiered / no tier requests/s: {tier['fits_rps'] / base['fits_rps']:.3f}")
    same = tier["answers"] == base["answers"] == ceiling["answers"]
    print(f"greedy second-turn answers equal across the three servers: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
