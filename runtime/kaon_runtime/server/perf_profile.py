"""`kaon profile`: measure one engine's performance model and write it as JSON.

    kaon profile [--out FILE] [--max-bytes N] [grid flags] -- <the `kaon serve` arguments>

It starts `kaon serve` with the given arguments on a free loopback port (prefix caching off,
so every repeat prefills in full) and measures it through its HTTP API, as a client sees it:

- cold start: from process start to /ready answering 200 (import, weight load, warm-up);
- decode step time over a grid of batch size B and context length L: B concurrent streamed
  requests with an L-token prompt and a fixed number of output tokens (ignore_eos); once
  every prompt is prefilled all B decode together and every stream event is one engine step,
  so a low quantile of the times between events is the step time at (B, B x L);
- prefill cost per token: one request at a time, prompts of several lengths, max_tokens 1,
  so the request's latency is one prefill step.
Of repeated measurements the low quantile is kept: on a shared machine contention only ever
adds time.

- the KV cache's size in tokens, as the server's /metrics states it.

The fit and the JSON's size are perf_fit.py's. The JSON is what the operator's
`perf_model.PerfModel.from_json` reads (the two packages share this format, not code): the
coefficients, the measured grid, the cold start, the engine's batch limits and KV cache size,
and the `key` it was measured on (device, model, quantization, dtype, tensor parallelism).
`--max-bytes`: the operator's profiling Job writes the model to the container's termination
message, which the kubelet cuts at 4 KiB (perf_fit.fitting).
`KAON_PROFILE_ARGS` (shell words) is read before the command line's own flags: the profiling
Job runs with the engine's environment, so a spec can narrow the grid (the tests' small one).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import asdict

import aiohttp

from kaon_runtime.engine.admission import serving_max_num_seqs
from kaon_runtime.engine.remote_prefill import step_token_budget
from kaon_runtime.server.perf_fit import GridPoint, fit, fitting

BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
CONTEXT_LENGTHS = (0, 384)  # 0: a short prompt
PROMPT_LENGTHS = (64, 256, 512, 1024)
MAX_CONTEXT_TOKENS = 8192  # a decode point's batch x context at most: prefilling more first takes minutes on a CPU
DECODE_TOKENS = 32
REPEATS = 4
SHORT_PROMPT = "Once upon a time," * 2
WORD = " river"  # prompts are this word repeated; their token counts are read back from the server
READY_TIMEOUT_SECONDS = 1800.0
REQUEST_TIMEOUT_SECONDS = 600.0


def low_quantile(values: list[float], q: float = 0.25) -> float:
    ordered = sorted(values)
    return ordered[int(q * (len(ordered) - 1))]


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaon profile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="-", help="where to write the model's JSON (default: stdout)")
    parser.add_argument("--max-bytes", type=int, help="write it compact, leaving grid points out to fit")
    parser.add_argument("--batch-sizes", type=_ints, default=BATCH_SIZES, help="comma-separated")
    parser.add_argument("--context-lengths", type=_ints, default=CONTEXT_LENGTHS,
                        help="prompt tokens of the decode points (0: a short prompt), comma-separated")
    parser.add_argument("--max-context-tokens", type=int, default=MAX_CONTEXT_TOKENS,
                        help="decode points whose batch x context exceeds this are skipped")
    parser.add_argument("--prompt-lengths", type=_ints, default=PROMPT_LENGTHS,
                        help="prompt words of the prefill points, comma-separated")
    parser.add_argument("--decode-tokens", type=int, default=DECODE_TOKENS, help="steps timed per decode point")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="requests per prefill point")
    parser.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then the `kaon serve` arguments")
    return parser


def _serve_settings(serve_args: list[str]) -> argparse.Namespace:
    """The few `kaon serve` flags the model records (its batch limits and its key)."""
    parser = argparse.ArgumentParser(add_help=False)
    for flag, default in (("--model", None), ("--quantization", "none"), ("--dtype", "auto"),
                          ("--kv-cache-dtype", "auto"), ("--tensor-parallel-size", "1"),
                          ("--max-num-seqs", None), ("--max-num-batched-tokens", None), ("--device", "auto"),
                          ("--role", "both")):
        parser.add_argument(flag, default=default)
    settings = parser.parse_known_args(serve_args)[0]
    # unset: the server's own default for the device (engine/admission.py)
    settings.max_num_seqs = serving_max_num_seqs(None if settings.max_num_seqs is None else int(settings.max_num_seqs),
                                                 settings.device)
    settings.max_num_batched_tokens = step_token_budget(  # unset: the role's (a decode engine's 256-token steps)
        None if settings.max_num_batched_tokens is None else int(settings.max_num_batched_tokens), settings.role)
    return settings


def _device() -> str:
    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}"
    return f"cpu ({os.cpu_count()} cores)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Profiler:
    """Measures one running `kaon serve` at `base` (http://host:port)."""

    def __init__(self, session: aiohttp.ClientSession, base: str, model: str):
        self.session, self.base, self.model = session, base, model

    async def _gaps(self, prompt: str, tokens: int) -> list[float]:
        """Times between the stream's events of one request (one event per engine step)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True,
                "ignore_eos": True}
        stamps = []
        async with self.session.post(f"{self.base}/v1/completions", json=body) as response:
            response.raise_for_status()
            async for raw in response.content:
                line = raw.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    stamps.append(time.perf_counter())
        return [b - a for a, b in itertools.pairwise(stamps)]

    async def decode_step(self, batch: int, context_words: int, decode_tokens: int) -> float:
        prompt = WORD * context_words if context_words else SHORT_PROMPT
        skip = 4 + batch * context_words // 1024  # the steps that may still prefill the others' prompts
        gaps = await asyncio.gather(*(self._gaps(prompt, skip + decode_tokens) for _ in range(batch)))
        return low_quantile([g for stream in gaps for g in stream[skip:]])

    async def prefill(self, words: int, repeats: int) -> tuple[int, float]:
        """(prompt tokens, seconds) of a one-token completion of a `words`-word prompt."""
        body = {"model": self.model, "prompt": WORD * words, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        times, tokens = [], 0
        for _ in range(repeats):
            start = time.perf_counter()
            async with self.session.post(f"{self.base}/v1/completions", json=body) as response:
                response.raise_for_status()
                tokens = (await response.json())["usage"]["prompt_tokens"]
            times.append(time.perf_counter() - start)
        return tokens, low_quantile(times)


async def measure(base: str, args: argparse.Namespace, settings: argparse.Namespace) -> list[GridPoint]:
    """The grid, measured on the server at `base`."""
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_SECONDS)
    limit = max(args.batch_sizes) + 4
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=limit)) as session:
        async with session.get(f"{base}/v1/models") as response:
            model = (await response.json())["data"][0]["id"]
        profiler = Profiler(session, base, model)
        await profiler.decode_step(2, 0, args.decode_tokens)  # warm-up
        short_tokens, _ = await profiler.prefill(len(SHORT_PROMPT.split()), 1)
        context_tokens = {0: short_tokens, **{n: (await profiler.prefill(n, 1))[0]
                                              for n in args.context_lengths if n}}
        grid = []
        for context, batch in itertools.product(args.context_lengths, args.batch_sizes):
            if batch * context > args.max_context_tokens:
                continue
            step = await profiler.decode_step(batch, context, args.decode_tokens)
            grid.append(GridPoint(batch, 0, batch * (context_tokens[context] + args.decode_tokens / 2), step))
        budget = int(settings.max_num_batched_tokens)
        for words in args.prompt_lengths:
            tokens, seconds = await profiler.prefill(words, args.repeats)
            if tokens <= budget:  # one chunk, one step: a + c tokens + d tokens (+ HTTP)
                grid.append(GridPoint(0, tokens, tokens, seconds))
    return grid


def kv_cache_tokens(base: str) -> int | None:
    """The KV cache's size in tokens, as the server's /metrics states it (None: not stated)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
        text = response.read().decode()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "kaon_kv_cache_capacity_tokens" and sample.value > 0:
                return int(sample.value)
    return None


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = READY_TIMEOUT_SECONDS) -> None:
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"kaon serve exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"kaon serve not ready after {timeout:.0f}s")


def profile(args: argparse.Namespace, log=None) -> dict:
    """Start `kaon serve` with args.serve_args, measure it, stop it; the model as a JSON-ready dict."""
    serve_args = [a for a in args.serve_args if a != "--"]
    settings = _serve_settings(serve_args)
    port = _free_port()
    command = [sys.executable, "-m", "kaon_runtime.cli", "serve", *serve_args,
               "--host", "127.0.0.1", "--port", str(port), "--no-enable-prefix-caching"]
    started = time.perf_counter()
    proc = subprocess.Popen(command, stdout=log or subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        wait_ready(f"http://127.0.0.1:{port}/ready", proc)
        cold_start = time.perf_counter() - started
        kv_tokens = kv_cache_tokens(f"http://127.0.0.1:{port}")
        grid = asyncio.run(measure(f"http://127.0.0.1:{port}", args, settings))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
    a, b, c, d = fit(grid)
    return {"a": round(a, 7), "b": round(b, 8), "c": round(c, 9), "d": round(d, 11),
            "cold_start_seconds": round(cold_start, 2), "max_num_seqs": int(settings.max_num_seqs),
            "max_num_batched_tokens": int(settings.max_num_batched_tokens), "kv_cache_tokens": kv_tokens,
            "key": {"device": _device(), "model": settings.model, "quantization": settings.quantization,
                    "dtype": settings.dtype, "kv_cache_dtype": settings.kv_cache_dtype,
                    "tensor_parallel_size": int(settings.tensor_parallel_size)},
            "grid": [asdict(GridPoint(p.batch, p.prefill_tokens, p.context_tokens, round(p.seconds, 6)))
                     for p in grid]}


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args([*shlex.split(os.environ.get("KAON_PROFILE_ARGS", "")), *argv])
    if not [a for a in args.serve_args if a != "--"]:
        print("kaon profile: error: give the `kaon serve` arguments after --", file=sys.stderr)
        return 2
    try:
        text = fitting(profile(args, log=sys.stderr), args.max_bytes)
    except (RuntimeError, TimeoutError, ValueError, aiohttp.ClientError) as exc:
        print(f"kaon profile: error: {exc}", file=sys.stderr)
        return 1
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as out:
            out.write(text)
    return 0
