"""Constrained decoding's cost and validity, with and without grammars in one run (CPU by default).

    python bench/structured.py [--batch 1 32] [--tokens 24] [--repeats 3] [--valid 24]
                               [--serve-batch 1 8] [--serve-tokens 64] [--json out.json]

- Per-token overhead: a mix of requests (a JSON schema, a forced tool call, free text, in turn)
  decoded at batch 1 and batch B, once with the schema and tool requests constrained and once
  with the same prompts unconstrained. Every request runs exactly --tokens tokens (ignore_eos;
  the prompts ask for more than that), so both runs have the same batch at every step; the
  figure is the mean decode step (prefill steps left out) with grammars against without,
  alternating which goes first, the fastest of the repeats each (interference only adds time).
  On a shared machine that difference is within the noise, so the grammar work itself is timed
  too: filling the masks (on the worker thread, beside the forward pass) and applying them
  (on the critical path), per decode step.
- Time to first token of a schema request with a cold compiled-grammar cache (a schema never
  seen) and a cached one, and the compile alone.
- Validity: --valid requests of each constrained kind at temperature 1 with seeds, run to their
  end; the share whose output parses and validates (Person with pydantic; the tool calls with
  the Hermes parser and the function's parameters, at most MAX_PARALLEL_CALLS of them).
- End to end (structured_serve.py): decode tokens/s through a `kaon serve` process of the same
  chat requests with and without response_format json_schema, at batch 1 and 8, as a ratio.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the Person model, the server helper

from pydantic import BaseModel, ConfigDict, Field
from structured_serve import serve_overhead

import kaon_runtime.engine.model_runner as model_runner
import kaon_runtime.structured.step_masks as step_masks
from kaon_runtime import LLM, SamplingParams
from kaon_runtime.structured.spec import GrammarSpec
from kaon_runtime.structured.tool_grammar import MAX_PARALLEL_CALLS, forced_call_tag
from kaon_runtime.structured.tool_parsers import parser_named
from kaon_runtime.structured.tool_prompt import prepare_messages
from tests.support.structured_models import Person


class WeatherArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    city: str = Field(max_length=30)
    unit: Literal["celsius", "fahrenheit"]


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": WeatherArgs.model_json_schema()}}
HERMES = parser_named("hermes")
SCHEMA_PROMPT = [{"role": "user", "content": "Invent a person who lives in France and describe them in JSON."}]
TOOL_PROMPT = [{"role": "user", "content": "What is the weather like in Lyon and in Nice?"}]
TEXT_PROMPT = [{"role": "user", "content": "Write a long story about a lighthouse keeper and a storm."}]


def requests(llm: LLM, kind: str, constrained: bool) -> tuple[str, dict]:
    """(prompt, SamplingParams fields) of one request of the mix."""
    tok = llm.tokenizer
    if kind == "schema":
        return tok.apply_chat_template(SCHEMA_PROMPT), (
            {"json_schema": Person.model_json_schema()} if constrained else {})
    if kind == "tool":
        messages = prepare_messages(TOOL_PROMPT, [WEATHER], tok.chat_template, HERMES)
        return tok.apply_chat_template(messages), (
            {"structural_tag": forced_call_tag([WEATHER["function"]], HERMES, parallel=True)} if constrained else {})
    return tok.apply_chat_template(TEXT_PROMPT), {}


class GrammarWork:
    """Time spent filling and applying masks, by wrapping the two functions the engine calls."""

    def __init__(self):
        self.fill = self.apply = 0.0
        self._fill, self._apply = step_masks.fill_step_masks, model_runner.apply_bitmasks
        step_masks.fill_step_masks = self._timed(self._fill, "fill")
        model_runner.apply_bitmasks = self._timed(self._apply, "apply")

    def _timed(self, function, name):
        def timed(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                setattr(self, name, getattr(self, name) + time.perf_counter() - start)
        return timed

    def reset(self) -> tuple[float, float]:
        out, self.fill, self.apply = (self.fill, self.apply), 0.0, 0.0
        return out


WORK = GrammarWork()


def decode_steps(llm: LLM, batch: int, tokens: int, constrained: bool) -> list[float]:
    """Wall time of each decode step of one batch of the mix."""
    engine = llm.engine
    kinds = ["schema", "tool", "text"] if batch > 1 else ["schema"]
    for i in range(batch):
        prompt, fields = requests(llm, kinds[i % len(kinds)], constrained)
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                                                           **fields))
    times, fills, applies = [], [], []
    while engine.has_unfinished_requests():
        decoding = all(seq.is_decoding for seq in engine.scheduler.running) and engine.scheduler.running
        full = len(engine.scheduler.running) == batch and not engine.scheduler.waiting
        WORK.reset()
        start = time.perf_counter()
        engine.step()
        if decoding and full:
            times.append(time.perf_counter() - start)
            fill, apply = WORK.reset()
            fills.append(fill)
            applies.append(apply)
    if constrained:
        LAST_WORK[batch] = (statistics.mean(fills), statistics.mean(applies))
    return times


LAST_WORK: dict[int, tuple[float, float]] = {}


def overhead(llm: LLM, batch: int, tokens: int, repeats: int) -> dict:
    best = {True: float("inf"), False: float("inf")}
    for r in range(repeats):
        for constrained in ((True, False) if r % 2 == 0 else (False, True)):
            steps = decode_steps(llm, batch, tokens, constrained)
            best[constrained] = min(best[constrained], statistics.mean(steps))
    fill, apply = LAST_WORK[batch]
    return {"batch": batch, "step_ms_with": best[True] * 1e3, "step_ms_without": best[False] * 1e3,
            "overhead": best[True] / best[False] - 1, "fill_ms": fill * 1e3, "apply_ms": apply * 1e3,
            "critical_path_share": apply / best[False]}


def time_to_first_token(llm: LLM, schema: dict) -> float:
    engine = llm.engine
    start = time.perf_counter()
    engine.add_request("ttft", llm.tokenizer.apply_chat_template(SCHEMA_PROMPT),
                       SamplingParams(temperature=0, max_tokens=1, json_schema=schema))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def compile_times(llm: LLM, repeats: int) -> dict:
    cold, cached, ttft_cold, ttft_cached = [], [], [], []
    grammars = llm.engine.grammars.cache
    for i in range(repeats):
        schema = Person.model_json_schema()
        schema["properties"][f"note{i}_{time.time_ns()}"] = {"type": "string"}  # never seen: a cold compile
        ttft_cold.append(time_to_first_token(llm, schema))
        ttft_cached.append(time_to_first_token(llm, schema))
        fresh = dict(schema, title=f"fresh{i}_{time.time_ns()}")
        spec = GrammarSpec.json_schema(fresh)
        start = time.perf_counter()
        grammars.compile(spec)
        cold.append(time.perf_counter() - start)
        start = time.perf_counter()
        grammars.compile(spec)
        cached.append(time.perf_counter() - start)
    return {"compile_ms_cold": statistics.median(cold) * 1e3, "compile_ms_cached": statistics.median(cached) * 1e3,
            "ttft_ms_cold": statistics.median(ttft_cold) * 1e3, "ttft_ms_cached": statistics.median(ttft_cached) * 1e3}


# Room for the longest replies: a Person, and MAX_PARALLEL_CALLS weather calls (a small model writes
# a forced call's text in up to ~80 tokens, often one character a token).
VALIDITY_MAX_TOKENS = {"schema": 200, "tool": 80 * MAX_PARALLEL_CALLS}


def validity(llm: LLM, count: int) -> dict:
    prompts, params, kinds = [], [], []
    for kind in ("schema", "tool"):
        prompt, fields = requests(llm, kind, constrained=True)
        for seed in range(count):
            prompts.append(prompt)
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=VALIDITY_MAX_TOKENS[kind], **fields))
            kinds.append(kind)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    valid, cut = {"schema": 0, "tool": 0}, {"schema": 0, "tool": 0}
    for kind, output in zip(kinds, outputs):
        out = output.outputs[0]
        cut[kind] += out.finish_reason == "length"
        valid[kind] += out.finish_reason == "stop" and is_valid(kind, out.text)
    return {f"valid_{kind}": f"{valid[kind]}/{count} ({cut[kind]} cut at max_tokens {VALIDITY_MAX_TOKENS[kind]})"
            for kind in valid}


def is_valid(kind: str, text: str) -> bool:
    try:
        if kind == "schema":
            Person.model_validate_json(text)
            return True
        calls = HERMES.parse(text, {"get_weather"}).calls
        for call in calls:
            WeatherArgs.model_validate_json(call.arguments)
        return 0 < len(calls) <= MAX_PARALLEL_CALLS
    except ValueError:
        return False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--tokens", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--valid", type=int, default=24, help="requests of each constrained kind for the validity rate")
    parser.add_argument("--serve-batch", type=int, nargs="*", default=[1, 8],
                        help="batch sizes of the end-to-end run through kaon serve (none: skip it)")
    parser.add_argument("--serve-tokens", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    llm = LLM(show_progress=False, device=args.device, dtype="float32" if args.device == "cpu" else "auto")
    results = {"overhead": [overhead(llm, b, args.tokens, args.repeats) for b in args.batch],
               **compile_times(llm, args.repeats), **validity(llm, args.valid),
               "serve": serve_overhead(args.serve_batch, args.serve_tokens, args.repeats, args.device)
               if args.serve_batch else []}
    for row in results["overhead"]:
        print(f"batch {row['batch']:>3}: decode step {row['step_ms_without']:.2f} ms without grammars, "
              f"{row['step_ms_with']:.2f} ms with ({row['overhead']:+.1%}); masks filled in {row['fill_ms']:.2f} ms "
              f"beside the forward pass, applied in {row['apply_ms']:.2f} ms ({row['critical_path_share']:.2%} "
              "of the step)")
    print(f"compile: cold {results['compile_ms_cold']:.1f} ms, cached {results['compile_ms_cached']:.3f} ms; "
          f"TTFT: cold schema {results['ttft_ms_cold']:.0f} ms, cached {results['ttft_ms_cached']:.0f} ms")
    print(f"valid: schema {results['valid_schema']}, tool call {results['valid_tool']}")
    for row in results["serve"]:
        print(f"kaon serve, batch {row['batch']}: decode {row['tok_s_without']:.1f} tok/s without response_format, "
              f"{row['tok_s_with']:.1f} with json_schema (ratio {row['ratio']:.3f}; {row['tokens']} tokens each, "
              f"{row['ended_short']} ended short)")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
