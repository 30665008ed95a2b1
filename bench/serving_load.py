"""A `vllm bench serve`-style load run: a constant (or Poisson) request rate of streamed
/v1/completions with random prompts, against `kaon serve` and, in the same run, HF transformers'
own generate loop behind a minimal OpenAI server (bench/hf_openai_server.py).

    python bench/serving_load.py [--request-rate 1] [--num-prompts 40] [--input-len 128] [--output-len 32]
                                 [--arrival constant|poisson] [--skip-peer]

As vLLM's benchmark does with its random dataset: each prompt is `--input-len` random token ids
of the model's vocabulary (special tokens left out) decoded to text, sent with `max_tokens:
--output-len` and `ignore_eos: true`, greedy. Per server it prints vLLM's result block:
successful and failed requests, duration, request and token throughput, TTFT, TPOT (per request:
(latency - TTFT) / (output tokens - 1)) and ITL (every gap between streamed chunks) as mean,
median and P99. Output tokens are the generated text re-tokenized by the model's tokenizer,
identically for both servers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
from serve import free_port, wait_ready  # noqa: E402  (bench/serve.py: the same server start-up)

from kaon_runtime.loader import load_checkpoint, resolve_model  # noqa: E402

MODEL = "builtin://smollm2-135m-instruct"
FIRST_ORDINARY_TOKEN = 100  # the special tokens of the builtin model sit below this id


@dataclass
class Result:
    ok: bool
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def random_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    vocab = tokenizer.backend.get_vocab_size()
    return [tokenizer.decode([rng.randrange(FIRST_ORDINARY_TOKEN, vocab) for _ in range(input_len)])
            for _ in range(n)]


def arrival_gaps(n: int, rate: float, arrival: str, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [1 / rate if arrival == "constant" else rng.expovariate(rate) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, output_len: int,
                      tokenizer) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True}
    start = last = time.perf_counter()
    ttft, itl, text = 0.0, [], []
    try:
        async with client.stream("POST", url, json=body, timeout=900) as response:
            if response.status_code != 200:
                return Result(False, error=f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return Result(False, error=str(event["error"])[:200])
                piece = event["choices"][0].get("text") if event.get("choices") else None
                if not piece:
                    continue
                now = time.perf_counter()
                if not text:
                    ttft = now - start
                else:
                    itl.append(now - last)
                last = now
                text.append(piece)
    except httpx.HTTPError as exc:
        return Result(False, error=repr(exc))
    if not text:
        return Result(False, error="no tokens")
    tokens = len(tokenizer.backend.encode("".join(text), add_special_tokens=False).ids)
    return Result(True, ttft, last - start, tokens, itl)


async def run_load(base: str, model: str, prompts: list[str], gaps: list[float], output_len: int,
                   tokenizer) -> tuple[list[Result], float]:
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(limits=limits) as client:
        tasks, start = [], time.perf_counter()
        for prompt, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(one_request(client, f"{base}/v1/completions", model, prompt,
                                                         output_len, tokenizer)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start


def summary(results: list[Result], duration: float, input_len: int) -> dict:
    done = [r for r in results if r.ok]
    out = sum(r.output_tokens for r in done)
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1]
    return {"completed": len(done), "failed": len(results) - len(done), "duration": duration,
            "input_tokens": input_len * len(done), "output_tokens": out,
            "request_throughput": len(done) / duration, "output_throughput": out / duration,
            "total_throughput": (out + input_len * len(done)) / duration,
            "ttft_ms": stats([r.ttft for r in done]), "tpot_ms": stats(tpot),
            "itl_ms": stats([gap for r in done for gap in r.itl]), "e2el_ms": stats([r.latency for r in done]),
            "errors": sorted({r.error for r in results if not r.ok})[:3]}


def stats(values: list[float]) -> dict:
    if not values:
        return {"mean": float("nan"), "median": float("nan"), "p99": float("nan")}
    ordered = sorted(v * 1e3 for v in values)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return {"mean": statistics.fmean(ordered), "median": statistics.median(ordered), "p99": p99}


def print_block(name: str, s: dict) -> None:
    """vLLM's benchmark_serving result block."""
    print(f"{' Serving Benchmark Result: ' + name + ' ':=^50}")
    rows = [("Successful requests:", s["completed"]), ("Failed requests:", s["failed"]),
            ("Benchmark duration (s):", f"{s['duration']:.2f}"), ("Total input tokens:", s["input_tokens"]),
            ("Total generated tokens:", s["output_tokens"]),
            ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
            ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
            ("Total Token throughput (tok/s):", f"{s['total_throughput']:.2f}")]
    for label, value in rows:
        print(f"{label:<40}{value:<10}")
    for title, key, short in [("Time to First Token", "ttft_ms", "TTFT"),
                              ("Time per Output Token (excl. 1st token)", "tpot_ms", "TPOT"),
                              ("Inter-token Latency", "itl_ms", "ITL"), ("End-to-end Latency", "e2el_ms", "E2EL")]:
        print(f"{title:-^50}")
        for stat, label in [("mean", "Mean"), ("median", "Median"), ("p99", "P99")]:
            print(f"{f'{label} {short} (ms):':<40}{s[key][stat]:<10.2f}")
    if s["errors"]:
        print("errors:", *s["errors"], sep="\n  ")
    print("=" * 50)


def bench(name: str, cmd: list[str], ready_path: str, port: int, args, prompts, gaps, tokenizer) -> dict:
    log = ROOT / "bench" / "out" / f"serving_load_{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "runtime")}
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + ready_path, proc, timeout=300)
        asyncio.run(run_load(base, MODEL, prompts[:2], [0.0, 0.0], 4, tokenizer))  # warm-up
        results, duration = asyncio.run(run_load(base, MODEL, prompts, gaps, args.output_len, tokenizer))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return summary(results, duration, args.input_len)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--request-rate", type=float, default=1.0)
    parser.add_argument("--arrival", choices=("constant", "poisson"), default="constant")
    parser.add_argument("--num-prompts", type=int, default=40)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-peer", action="store_true")
    parser.add_argument("--kaon-args", default="--device cpu", help="extra `kaon serve` flags")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    tokenizer = load_checkpoint(resolve_model(MODEL)).tokenizer
    prompts = random_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    gaps = arrival_gaps(args.num_prompts, args.request_rate, args.arrival, args.seed)
    print(f"{args.num_prompts} streamed /v1/completions at {args.request_rate} req/s ({args.arrival}), random "
          f"prompts of {args.input_len} tokens, {args.output_len} output tokens (ignore_eos), greedy")
    port = free_port()
    kaon_cmd = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--port", str(port),
                "--log-level", "warning", *args.kaon_args.split()]
    results = {"kaon": bench("kaon", kaon_cmd, "/ready", port, args, prompts, gaps, tokenizer)}
    print_block("kaon", results["kaon"])
    if not args.skip_peer:
        port = free_port()
        peer_cmd = [sys.executable, str(ROOT / "bench" / "hf_openai_server.py"), "--port", str(port)]
        results["hf"] = bench("hf", peer_cmd, "/v1/models", port, args, prompts, gaps, tokenizer)
        print_block("HF transformers generate", results["hf"])
        k, h = results["kaon"], results["hf"]
        print(f"kaon / HF: request throughput {k['request_throughput'] / h['request_throughput']:.2f}x, "
              f"TTFT P99 {h['ttft_ms']['p99'] / k['ttft_ms']['p99']:.2f}x lower, "
              f"TPOT median {k['tpot_ms']['median'] / h['tpot_ms']['median']:.2f}x HF's")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if all(r["failed"] == 0 for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
