"""Batch-1 decode with and without prompt-lookup speculative decoding, in one run.

    python bench/spec_decode.py [--num-speculative-tokens 4] [--repeats 2] [--device cpu]

Three workloads, greedy, one request at a time:
- code edit: code-editing requests, each quoting a code block and asking for it back with
  a small change; the answer ends at its closing code fence (a stop string), as a client
  that applies the edited code would stop it. Most of it copies the prompt: what prompt
  lookup is for;
- code edit, whole answer: the same requests without the stop, so the explanation the
  small model likes to add after the code (little of it copied) counts too;
- open: open-ended questions whose answers quote little of the prompt.

Each request runs on a plain engine and on one with prompt-lookup drafting, alternating
which goes first, and the two must produce the same tokens. Decode tokens/s leaves the
prefill step out: (tokens - 1) / time from the first token to the last, taking for each
request and engine the fastest of the repeats (on a shared machine, interference only
ever adds time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))

from kaon_runtime import LLM, SamplingParams

CODE_A = '''import json
from dataclasses import dataclass


@dataclass
class User:
    name: str
    email: str
    age: int


def load_users(path):
    with open(path) as f:
        rows = json.load(f)
    return [User(row["name"], row["email"], row["age"]) for row in rows]


def adults(users):
    return [u for u in users if u.age >= 18]


def main():
    users = load_users("users.json")
    for user in adults(users):
        print(user.name, user.email)


if __name__ == "__main__":
    main()
'''
CODE_B = '''def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)


def describe(width, height):
    return f"{width}x{height}: area {area(width, height)}, perimeter {perimeter(width, height)}"


for w, h in [(1, 2), (3, 4), (5, 6), (7, 8)]:
    print(describe(w, h))
'''
CODE_C = '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from an empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1]

    def __len__(self):
        return len(self.items)
'''
CODE_EDITS = [
        "Fix the bug in this code: adults should use > 18, not >= 18. Reply with the complete corrected file "
        "and nothing else.\n```python\n" + CODE_A + "```",
        "Rename `describe` to `summary` in this code. Reply with the complete file and nothing else.\n"
        "```python\n" + CODE_B + "```",
        "Make peek raise IndexError on an empty stack too. Reply with the complete class and nothing else.\n"
        "```python\n" + CODE_C + "```",
]
CLOSING_FENCE = "\n```"
WORKLOADS = {  # name: (requests, stop strings)
    "code edit": (CODE_EDITS, [CLOSING_FENCE]),
    "code, whole": (CODE_EDITS, []),
    "open": ([
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how vaccines train the immune system, for a curious twelve-year-old.",
        "What are the pros and cons of working from home? Give a balanced answer.",
    ], []),
}


@dataclass(slots=True)
class Run:
    tokens: list[int]
    decode_s: float
    drafted: int
    accepted: int
    steps: int


def run_one(llm: LLM, prompt: list[int], params: SamplingParams, request_id: str) -> Run:
    engine = llm.engine
    before = engine.stats()
    engine.add_request(request_id, prompt, params)
    engine.step()  # prefill and the first token
    start, steps, output = time.perf_counter(), 0, None
    while engine.has_unfinished_requests():
        for out in engine.step():
            output = out
        steps += 1
    decode_s = time.perf_counter() - start
    after = engine.stats()
    return Run(output.outputs[0].token_ids, decode_s, after.spec_draft_tokens - before.spec_draft_tokens,
               after.spec_accepted_tokens - before.spec_accepted_tokens, steps)


def bench(plain: LLM, spec: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int) -> dict:
    fastest = {"plain": [float("inf")] * len(prompts), "spec": [float("inf")] * len(prompts)}
    decode_tokens = drafted = accepted = steps = 0
    for r in range(repeats):
        for i, prompt in enumerate(prompts):
            order = [("plain", plain), ("spec", spec)]
            runs = {name: run_one(llm, prompt, params, f"{name}-{r}-{i}")
                    for name, llm in (order if (r + i) % 2 == 0 else order[::-1])}
            assert runs["plain"].tokens == runs["spec"].tokens, "speculation changed a greedy output"
            for name, run in runs.items():
                fastest[name][i] = min(fastest[name][i], run.decode_s)
            if r == 0:
                spec_run = runs["spec"]
                decode_tokens += len(spec_run.tokens) - 1
                drafted, accepted, steps = drafted + spec_run.drafted, accepted + spec_run.accepted, \
                    steps + spec_run.steps
    plain_rate, spec_rate = decode_tokens / sum(fastest["plain"]), decode_tokens / sum(fastest["spec"])
    return {"output_tokens": decode_tokens + len(prompts), "plain_tok_s": plain_rate, "spec_tok_s": spec_rate,
            "speedup": spec_rate / plain_rate, "acceptance": accepted / max(drafted, 1),
            "tokens_per_step": decode_tokens / max(steps, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="builtin://smollm2-135m-instruct")
    parser.add_argument("--num-speculative-tokens", type=int, default=6)
    parser.add_argument("--prompt-lookup-max", type=int, default=8)
    parser.add_argument("--prompt-lookup-min", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args()
    common = dict(show_progress=False, device=args.device, dtype=args.dtype)
    plain = LLM(args.model, **common)
    spec = LLM(args.model, speculative_method="ngram", num_speculative_tokens=args.num_speculative_tokens,
               prompt_lookup_max=args.prompt_lookup_max, prompt_lookup_min=args.prompt_lookup_min, **common)
    results = {}
    for name, (questions, stop) in WORKLOADS.items():
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, stop=stop)
        prompts = [plain.encode_chat([{"role": "user", "content": q}]) for q in questions]
        run_one(plain, prompts[0], SamplingParams(temperature=0, max_tokens=8), f"warm-{name}")
        run_one(spec, prompts[0], SamplingParams(temperature=0, max_tokens=8), f"warm-{name}")
        results[name] = bench(plain, spec, prompts, params, args.repeats)
    if args.json:
        print(json.dumps({"k": args.num_speculative_tokens, **results}))
        return
    print(f"k={args.num_speculative_tokens}, prompt lookup n-grams {args.prompt_lookup_min}..{args.prompt_lookup_max}, "
          f"greedy, batch 1, decode tok/s from each request's fastest of {args.repeats} runs")
    print(f"{'workload':<13}{'tokens':>8}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'accepted':>10}"
          f"{'tok/step':>10}")
    for name, r in results.items():
        print(f"{name:<13}{r['output_tokens']:>8}{r['plain_tok_s']:>13.1f}{r['spec_tok_s']:>12.1f}"
              f"{r['speedup']:>8.2f}x{r['acceptance']:>10.0%}{r['tokens_per_step']:>10.2f}")


if __name__ == "__main__":
    main()
