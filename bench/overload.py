"""Overload: does `kaon serve` keep finishing work past its capacity? (issue 49 §6)

    python bench/overload.py [--kaon-args "--device cpu"] [--capacity-s 30] [--overload-s 60] [--factor 2]

One server, two phases, in the same run:
1. Capacity (1x): closed loop, `--concurrency` clients (default: twice the running batch the server
   admits, --max-num-seqs or its default for the device, so that a backlog keeps it at its best) each
   sending its next request as soon as the last one finished, for --capacity-s seconds, the last ones
   waited for: completed requests per second (over the time to the last completion) is the capacity.
2. Overload: an open loop at --factor x that capacity (constant arrivals) for --overload-s seconds, every
   request waited for to its end: completed requests per second over the offer (completions / offer's
   duration, so a server that finishes work only after the offer ends is not credited for it), time to
   first token of the completed ones, the refusals by status (429 / 503 with their Retry-After) and the
   requests lost (no answer, a dropped connection, or a stream that ended without [DONE]).

3. With --guidellm (the vLLM ecosystem's load generator, `bash bench/install_guidellm.sh` puts it in
   ~/.cache/kaon/guidellm-venv): guidellm's constant-rate profile at --factor x capacity for
   --guidellm-s seconds, synthetic 128-token prompts and 32 tokens out, against the same server; its
   report's successful / errored / incomplete counts are printed (and saved under bench/out/).

Requests are streamed /v1/completions of --input-len random tokens, --output-len tokens out (ignore_eos),
greedy, as bench/serving_load.py sends them. Prints one JSON summary; --json writes it too.
Pass: completed >= 80% of capacity, TTFT p99 of the completed within the admission limit
(--max-queue-wait, default 30 s), none lost.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "runtime"))
sys.path.insert(0, str(ROOT / "bench"))
from serve import free_port, wait_ready  # noqa: E402
from serving_load import random_prompts  # noqa: E402

from kaon_runtime.engine.admission import serving_max_num_seqs  # noqa: E402
from kaon_runtime.loader import load_checkpoint, resolve_model  # noqa: E402
from kaon_runtime.server.limits import MAX_QUEUE_WAIT_S  # noqa: E402

MODEL = "builtin://smollm2-135m-instruct"


@dataclass
class Outcome:
    status: int  # 200, or the refusal's status; 0: no answer (lost)
    sent: float  # since the phase began
    ttft: float = 0.0
    latency: float = 0.0
    complete: bool = False  # a 200 stream that ended with [DONE]
    retry_after: str | None = None
    error: str = ""


async def one(client: httpx.AsyncClient, url: str, prompt: str, output_len: int, t0: float) -> Outcome:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0,
            "stream": True}
    start = time.perf_counter()
    out = Outcome(0, start - t0)
    try:
        async with client.stream("POST", url, json=body, timeout=600) as response:
            out.status = response.status_code
            if response.status_code != 200:
                out.retry_after = response.headers.get("retry-after")
                out.error = (await response.aread())[:200].decode(errors="replace")
                return out
            async for line in response.aiter_lines():
                if line == "data: [DONE]":
                    out.complete = True
                elif line.startswith("data: ") and not out.ttft and '"text":""' not in line.replace(" ", ""):
                    if '"error"' in line:
                        out.error = line[:200]
                        continue
                    out.ttft = time.perf_counter() - start
        out.latency = time.perf_counter() - start
    except httpx.HTTPError as exc:
        out.status, out.error = 0, repr(exc)
    return out


async def closed_loop(base: str, prompts: list[str], concurrency: int, seconds: float, output_len: int) -> float:
    """Completed requests per second with `concurrency` clients each sending back to back for `seconds`.

    The requests in flight when the time is up are waited for and counted, over the time until the last
    one finished: cutting them off would drop up to `concurrency` requests' work (at a few requests per
    second, a large share of a short phase) and understate the capacity."""
    done = 0
    t0 = time.perf_counter()
    end = t0 + seconds

    async def client_loop(client: httpx.AsyncClient, k: int) -> None:
        nonlocal done
        i = k
        while time.perf_counter() < end:
            out = await one(client, f"{base}/v1/completions", prompts[i % len(prompts)], output_len, t0)
            if out.complete:
                done += 1
            i += concurrency

    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)) as client:
        await asyncio.gather(*(client_loop(client, k) for k in range(concurrency)))
    return done / (time.perf_counter() - t0)


async def open_loop(base: str, prompts: list[str], rate: float, seconds: float, output_len: int) -> list[Outcome]:
    n = int(rate * seconds)
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=n + 4)) as client:
        t0 = time.perf_counter()
        tasks = []
        for i in range(n):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(client, f"{base}/v1/completions", prompts[i % len(prompts)],
                                                 output_len, t0)))
        return list(await asyncio.gather(*tasks))


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def summarize(outcomes: list[Outcome], seconds: float, capacity: float) -> dict:
    completed = [o for o in outcomes if o.status == 200 and o.complete]
    in_window = [o for o in completed if o.sent + o.latency <= seconds]
    refused: dict[str, int] = {}
    for o in outcomes:
        if o.status not in (0, 200):
            refused[str(o.status)] = refused.get(str(o.status), 0) + 1
    lost = [o for o in outcomes if o.status == 0 or (o.status == 200 and not o.complete)]
    return {"offered": len(outcomes), "completed": len(completed), "completed_in_window": len(in_window),
            "completed_per_s": len(in_window) / seconds, "ratio_to_capacity": len(in_window) / seconds / capacity,
            "ttft_s": {"p50": percentile([o.ttft for o in completed], 0.5),
                       "p99": percentile([o.ttft for o in completed], 0.99),
                       "max": max((o.ttft for o in completed), default=float("nan"))},
            "refused": refused,
            "retry_after": sorted({o.retry_after for o in outcomes if o.retry_after}),
            "refusal_sample": next((o.error for o in outcomes if o.status not in (0, 200)), ""),
            "lost": len(lost), "lost_sample": [o.error for o in lost[:3]]}


def run_guidellm(args, base: str, rate: float, tokenizer) -> dict:
    """guidellm's constant profile at `rate` against the running server; its request counts."""
    out = ROOT / "bench" / "out"
    tokenizer_dir = out / "guidellm_tokenizer"  # guidellm sizes its synthetic prompts with an HF tokenizer
    tokenizer_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.backend.save(str(tokenizer_dir / "tokenizer.json"))
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    report = out / "overload_guidellm.json"
    cmd = [str(args.guidellm), "run",
           "--backend", f"kind=openai_http,target={base},model={MODEL},request_format=/v1/completions",
           "--profile", f"kind=constant,rate={rate:.3f}",
           "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer_dir}",
           "--constraint", f"kind=max_duration,seconds={args.guidellm_s:g}",
           "--output", f"kind=json,path={report}", "--disable-progress"]
    print("guidellm:", " ".join(cmd), flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.guidellm_s * 10 + 300)
    (out / "overload_guidellm.log").write_text(done.stdout + done.stderr)
    print(done.stdout[-4000:], done.stderr[-2000:], sep="\n", flush=True)
    counts: dict = {"returncode": done.returncode}
    if report.exists():
        counts.update(_guidellm_counts(json.loads(report.read_text())))
    return counts


def _guidellm_counts(report: dict) -> dict:
    """successful / errored / incomplete request counts from guidellm's JSON report (searched by key, so a
    change of its nesting does not break the reading)."""
    found: dict = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("request_totals", "requests_made") and isinstance(value, dict):
                    found.setdefault(key, value)
                walk(value)
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(report)
    return found


def _flag(extra: list[str], name: str, kind):
    """A `kaon serve` flag's value in --kaon-args (None: not given)."""
    return kind(extra[extra.index(name) + 1]) if name in extra else None


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kaon-args", default="--device cpu", help="extra `kaon serve` flags")
    parser.add_argument("--concurrency", type=int, default=0, help="capacity phase's clients (0: twice the "
                        "server's --max-num-seqs, from --kaon-args or its default for the device)")
    parser.add_argument("--capacity-s", type=float, default=30.0)
    parser.add_argument("--overload-s", type=float, default=60.0)
    parser.add_argument("--factor", type=float, default=2.0)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--guidellm", type=Path, help="the guidellm executable (bench/install_guidellm.sh)")
    parser.add_argument("--guidellm-s", type=float, default=30.0)
    args = parser.parse_args()
    extra = args.kaon_args.split()
    # Twice the running batch: a backlog as deep as the batch keeps every slot busy and lets the server batch
    # what waits (--prefill-group), so the closed loop finds its best throughput, not one slowed by the
    # clients' own round trips
    concurrency = args.concurrency or 2 * serving_max_num_seqs(_flag(extra, "--max-num-seqs", int),
                                                               _flag(extra, "--device", str) or "auto")
    limit = _flag(extra, "--max-queue-wait", float)
    limit = MAX_QUEUE_WAIT_S if limit is None else (limit or None)  # 0: no admission limit
    tokenizer = load_checkpoint(resolve_model(MODEL)).tokenizer
    prompts = random_prompts(tokenizer, 400, args.input_len, 0)
    port = free_port()
    log = ROOT / "bench" / "out" / "overload_kaon.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "kaon_runtime.cli", "serve", "--model", MODEL, "--port", str(port),
           "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONPATH": str(ROOT / "runtime")})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_ready(base + "/ready", proc, timeout=300)
        asyncio.run(closed_loop(base, prompts, 2, 3, 4))  # warm-up
        capacity = asyncio.run(closed_loop(base, prompts, concurrency, args.capacity_s, args.output_len))
        print(f"capacity (closed loop, {concurrency} clients, {args.capacity_s:g} s): {capacity:.2f} req/s",
              flush=True)
        if capacity == 0:
            raise SystemExit("no request completed in the capacity phase: a longer --capacity-s, or a quieter machine")
        rate = args.factor * capacity
        outcomes = asyncio.run(open_loop(base, prompts, rate, args.overload_s, args.output_len))
        guide = run_guidellm(args, base, rate, tokenizer) if args.guidellm else None
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    result = {"kaon_args": args.kaon_args, "capacity_per_s": capacity, "offered_per_s": rate,
              "overload_s": args.overload_s, **summarize(outcomes, args.overload_s, capacity)}
    if guide is not None:
        result["guidellm"] = guide
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    result["admission_limit_s"] = limit
    within = limit is None or not result["completed"] or result["ttft_s"]["p99"] <= limit
    ok = result["ratio_to_capacity"] >= 0.8 and result["lost"] == 0 and within
    print(f"completed {result['completed_per_s']:.2f} req/s at {args.factor:g}x = {result['ratio_to_capacity']:.2f}x "
          f"capacity; TTFT p99 {result['ttft_s']['p99']:.2f} s, max {result['ttft_s']['max']:.2f} s (admission limit "
          f"{limit} s); refused {result['refused']}; lost {result['lost']}: "
          f"{'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
