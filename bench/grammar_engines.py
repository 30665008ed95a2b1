"""Which grammar engine: xgrammar, llguidance and outlines-core on one schema, one vocabulary, one output.

    python bench/grammar_engines.py [--repeats 5] [--json out.json]

The Person schema (tests/support/structured_models.py: nested object, pattern, enum, bounded
array, integer range, no extra keys), the bundled model's vocabulary, and JSON without free
whitespace (xgrammar's ", " and ": " separators; outlines-core's regex allows one optional space).
Per engine: the time to compile the schema for the vocabulary (llguidance builds its matcher
lazily, so its figure is the matcher's construction), and the mean time of one decode step's
grammar work (fill the next-token mask, then take the token) along the same valid output: the
bundled model's greedy constrained answer. Each engine must accept every token of it and end
there, or the run says so. Single-threaded, the fastest of the repeats (the machine is shared).
"""
from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support: the Person model

import torch

from kaon_runtime import LLM, SamplingParams
from tests.support.structured_models import Person

PROMPT = [{"role": "user", "content": "Invent a person who lives in France and describe them in JSON."}]


def timed(function, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        best = min(best, time.perf_counter() - start)
    return best, result


def xgrammar_engine(llm: LLM, schema: str, tokens: list[int], repeats: int) -> dict:
    import xgrammar as xgr

    from kaon_runtime.structured.compiler import tokenizer_info
    info = tokenizer_info(llm.tokenizer, llm.engine.grammars.cache.vocab_size)

    def compile_():
        return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False).compile_json_schema(
            schema, any_whitespace=False)
    compile_s, compiled = timed(compile_, repeats)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def walk():
        matcher, ok = xgr.GrammarMatcher(compiled), True
        for token in tokens:
            matcher.fill_next_token_bitmask(bitmask, 0)
            ok = ok and matcher.accept_token(token)
        return ok and matcher.is_terminated()
    walk_s, ok = timed(walk, repeats)
    return {"engine": f"xgrammar {importlib.metadata.version('xgrammar')}", "compile_ms": compile_s * 1e3,
            "step_us": walk_s / len(tokens) * 1e6, "accepts_the_output": ok}


def llguidance_engine(llm: LLM, schema: str, tokens: list[int], repeats: int) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    from transformers import PreTrainedTokenizerFast
    vocab_size = llm.engine.grammars.cache.vocab_size
    fast = PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.backend)
    lltok = llguidance.hf.from_tokenizer(fast, n_vocab=vocab_size, eos_token=list(llm.tokenizer.eos_token_ids))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={
        "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})  # xgrammar's compact form
    compile_s, _ = timed(lambda: llguidance.LLMatcher(lltok, grammar), repeats)
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab_size)

    def walk():
        matcher, ok = llguidance.LLMatcher(lltok, grammar), True
        for token in tokens:
            llguidance.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            ok = ok and matcher.consume_token(token)
        return ok and not matcher.is_error() and matcher.is_accepting()
    walk_s, ok = timed(walk, repeats)
    return {"engine": f"llguidance {llguidance.get_version()}", "compile_ms": compile_s * 1e3,
            "step_us": walk_s / len(tokens) * 1e6, "accepts_the_output": ok}


def outlines_engine(llm: LLM, schema: str, tokens: list[int], repeats: int) -> dict:
    import outlines_core
    from outlines_core.json_schema import build_regex_from_schema
    eos, stops = tokens[-1], set(llm.tokenizer.eos_token_ids)  # the stop token the output ended with
    by_text: dict[bytes, list[int]] = {}
    to_byte = _byte_level_alphabet()
    for token, index in llm.tokenizer.backend.get_vocab(with_added_tokens=True).items():
        if index not in stops:
            text = b"".join(bytes([to_byte[ch]]) if ch in to_byte else ch.encode() for ch in token)
            by_text.setdefault(text, []).append(index)
    vocabulary = outlines_core.Vocabulary(eos, {k: v for k, v in by_text.items() if k})
    regex = build_regex_from_schema(schema, whitespace_pattern="[ ]?")  # takes xgrammar's ", " and ": "
    compile_s, index = timed(lambda: outlines_core.Index(regex, vocabulary), repeats)
    size = llm.engine.grammars.cache.vocab_size
    mask = torch.zeros((size + 31) // 32, dtype=torch.int32)

    def walk():
        guide = outlines_core.Guide(index)
        try:
            for token in tokens[:-1]:
                guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
                guide.advance(token)  # raises for a token the grammar does not allow
        except ValueError:
            return False
        guide.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
        return guide.is_finished() and eos in guide.get_tokens()  # a final state: the stop token ends it
    walk_s, ok = timed(walk, repeats)
    return {"engine": f"outlines-core {importlib.metadata.version('outlines-core')}", "compile_ms": compile_s * 1e3,
            "step_us": walk_s / len(tokens) * 1e6, "accepts_the_output": ok}


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (the bundled model's): the character that stands for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(others)}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)
    llm = LLM(show_progress=False, device="cpu", dtype="float32")
    schema = json.dumps(Person.model_json_schema())
    params = SamplingParams(temperature=0, max_tokens=200, json_schema=schema)
    out = llm.generate([llm.tokenizer.apply_chat_template(PROMPT)], [params], use_tqdm=False)[0].outputs[0]
    Person.model_validate_json(out.text)
    tokens = list(out.token_ids)  # ends with the stop token the grammar asks for
    rows = [engine(llm, schema, tokens, args.repeats)
            for engine in (xgrammar_engine, llguidance_engine, outlines_engine)]
    print(f"{len(tokens)} tokens: {out.text}")
    for row in rows:
        print(f"{row['engine']:>22}: compile {row['compile_ms']:9.1f} ms, mask + advance {row['step_us']:8.1f} us "
              f"per token, accepts the output: {row['accepts_the_output']}")
    if args.json:
        args.json.write_text(json.dumps({"tokens": len(tokens), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
