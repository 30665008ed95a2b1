"""`kaon` command line: `kaon generate` now; `kaon serve` joins it with the server."""
from __future__ import annotations

import argparse
import sys
import time

from kaon_runtime.config import DEFAULT_MODEL
from kaon_runtime.errors import KaonError

DEMO_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about Kubernetes.",
    "Explain in one sentence what a KV cache is.",
    "Give me three tips for writing clean Python code.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kaon", description="kaon: serve LLMs on Kubernetes")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate offline for a few prompts")
    gen.add_argument("--model", default=DEFAULT_MODEL)
    gen.add_argument("--prompt", action="append", help="repeatable; defaults to a few demo questions")
    gen.add_argument("--raw", action="store_true", help="send prompts as-is instead of through the chat template")
    gen.add_argument("--max-tokens", type=int, default=96)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--stop", action="append", default=[])
    gen.add_argument("--device", default="auto")
    gen.add_argument("--dtype", default="auto")
    args = parser.parse_args(argv)
    try:
        return _generate(args)
    except KaonError as exc:
        print(f"kaon: error: {exc}", file=sys.stderr)
        return 2


def _generate(args) -> int:
    from kaon_runtime.llm import LLM
    from kaon_runtime.sampling import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            max_tokens=args.max_tokens, stop=args.stop)
    llm = LLM(model=args.model, device=args.device, dtype=args.dtype)
    prompts = args.prompt or DEMO_PROMPTS
    start = time.perf_counter()
    if args.raw:
        outputs = llm.generate(prompts, params)
    else:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    elapsed = time.perf_counter() - start
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        print(f"\n>>> {prompt}\n{completion.text.strip()}\n[{len(completion.token_ids)} tokens, "
              f"finish: {completion.finish_reason}]")
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n{generated} tokens in {elapsed:.2f}s ({generated / elapsed:.1f} tokens/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
