"""Serving benchmark: kaon vs llama.cpp's server on the same GGUF, same requests, one run.

    python bench/serve.py [--rates 0.5 1 2] [--requests 20]

For each request rate, requests arrive as a Poisson process; each is a streamed
/v1/completions call (greedy) with a prompt of 32-256 tokens and max_tokens 16-96.
Reported per server and rate: output throughput, TTFT, ITL (per request: time between
the first and last token divided by the tokens in between) and end-to-end latency, p50
and p99. Output tokens are counted by tokenizing the returned text with the model's
tokenizer, identically for both servers. The peer is llama-cpp-python's OpenAI server
(`pip install 'llama-cpp-python[server]'`), which runs the GGUF's Q4_1 weights natively
and serves one request at a time; kaon dequantizes to float32 and batches continuously.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
# Importing kaon_runtime tunes OpenMP through the environment; llama.cpp shares that runtime,
# so its server starts with the environment as the user had it.
USER_ENV = dict(os.environ)

from kaon_runtime.loader import load_checkpoint, resolve_model  # noqa: E402

MODEL = "builtin://smollm2-135m-instruct"
CORPUS = ("The river kept its own calendar. In spring it ran brown and fast with snowmelt, in summer it slowed "
          "and warmed until children could wade across, and in autumn it carried the leaves of every town "
          "upstream past the mill, where the miller counted them as other people count coins. ")


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_kaon_with(port: int, log: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--port", str(port), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime")}
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


def start_llama_cpp(port: int, gguf: Path, log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2",
           "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "4096", "--n_threads", str(os.cpu_count()),
           "--interrupt_requests", "False"]  # by default a new request cancels the one in flight
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=USER_ENV)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see its log")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def make_requests(tokenizer, n: int, seed: int) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    corpus = tokenizer.encode(CORPUS * 12)
    out = []
    for _ in range(n):
        start, length = rng.randint(0, 100), rng.randint(32, 256)
        out.append((tokenizer.decode(corpus[start:start + length]), rng.randint(16, 96)))
    return out


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
                      tokenizer) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    start = time.perf_counter()
    first, text = None, []
    try:
        async with client.stream("POST", url, json=body, timeout=600) as response:
            if response.status_code != 200:
                return Result(False)
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                piece = json.loads(line[6:])["choices"][0].get("text") or ""
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    except httpx.HTTPError:
        return Result(False)
    end = time.perf_counter()
    if first is None:
        return Result(False)
    return Result(True, first - start, end - start, len(tokenizer.encode("".join(text))))


async def run_rate(base: str, model: str, requests, rate: float, tokenizer, seed: int) -> dict:
    rng = random.Random(seed)
    url = f"{base}/v1/completions"
    limits = httpx.Limits(max_connections=len(requests) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for prompt, max_tokens in requests:
            tasks.append(asyncio.create_task(one_request(client, url, model, prompt, max_tokens, tokenizer)))
            await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        makespan = time.perf_counter() - start
    done = [r for r in results if r.ok]
    itl = [(r.e2e - r.ttft) / (r.tokens - 1) for r in done if r.tokens > 1]
    return {"rate": rate, "ok": len(done), "failed": len(results) - len(done),
            "out_tok_s": sum(r.tokens for r in done) / makespan,
            "ttft": percentiles([r.ttft for r in done]), "itl": percentiles(itl),
            "e2e": percentiles([r.e2e for r in done])}


def percentiles(values: list[float]) -> tuple[float, float]:
    if not values:
        return (float("nan"), float("nan"))
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


def bench_server(name, proc, base, ready_path, model, rates, requests, tokenizer, seed) -> list[dict]:
    try:
        wait_ready(base + ready_path, proc)
        asyncio.run(run_rate(base, model, requests[:2], 10.0, tokenizer, seed))  # warm-up
        return [dict(server=name, **asyncio.run(run_rate(base, model, requests, rate, tokenizer, seed)))
                for rate in rates]
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--kaon-args", default="", help='extra `kaon serve` flags, e.g. "--max-num-batched-tokens 128"')
    args = parser.parse_args()
    gguf = resolve_model(MODEL)
    tokenizer = load_checkpoint(gguf).tokenizer
    requests = make_requests(tokenizer, args.requests, args.seed)
    logs = ROOT / "bench" / "out"
    logs.mkdir(parents=True, exist_ok=True)

    port = free_port()
    kaon = start_kaon_with(port, logs / "kaon_serve.log", args.kaon_args.split())
    rows = bench_server("kaon", kaon, f"http://127.0.0.1:{port}", "/ready",
                        MODEL, args.rates, requests, tokenizer, args.seed)
    if not args.skip_peer:
        port = free_port()
        rows += bench_server("llama.cpp", start_llama_cpp(port, gguf, logs / "llama_cpp_serve.log"),
                             f"http://127.0.0.1:{port}", "/v1/models", "smollm2", args.rates, requests, tokenizer,
                             args.seed)
    print(f"{args.requests} streamed requests per rate, prompts 32-256 tokens, max_tokens 16-96, greedy")
    print(f"{'server':10} {'rate':>5} {'ok':>4} {'out tok/s':>9}  {'TTFT p50/p99 s':>16}  "
          f"{'ITL p50/p99 ms':>16}  {'E2E p50/p99 s':>16}")
    for r in rows:
        print(f"{r['server']:10} {r['rate']:5.2f} {r['ok']:4d} {r['out_tok_s']:9.1f}  "
              f"{r['ttft'][0]:7.2f} / {r['ttft'][1]:6.2f}  {r['itl'][0] * 1e3:7.1f} / {r['itl'][1] * 1e3:6.1f}  "
              f"{r['e2e'][0]:7.2f} / {r['e2e'][1]:6.2f}")
    if not args.skip_peer:
        for rate in args.rates:
            k, p = (next(r for r in rows if r["server"] == s and r["rate"] == rate) for s in ("kaon", "llama.cpp"))
            print(f"rate {rate}: kaon/llama.cpp throughput {k['out_tok_s'] / p['out_tok_s']:.2f}x, "
                  f"TTFT p99 {p['ttft'][1] / k['ttft'][1]:.2f}x lower, E2E p99 {p['e2e'][1] / k['e2e'][1]:.2f}x lower")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
