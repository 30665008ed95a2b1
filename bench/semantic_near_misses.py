"""The semantic cache's false hits on near misses, with the real all-MiniLM-L6-v2 (kaon's encoder).

    .venv/bin/python bench/semantic_near_misses.py [--embedder builtin://all-minilm-l6-v2]
        [--near-misses routing_near_misses_heldout.jsonl] [--paraphrases routing_cache_pairs.jsonl]
    .venv/bin/python bench/semantic_near_misses.py --heldout [--half all|dev|test]
    .venv/bin/python bench/semantic_near_misses.py --heldout2

A near miss is a question that differs from a cached one in a way that changes the answer (another
name, number, direction, polarity, language): bench/data/routing_near_misses.jsonl, written from
templates by bench/data/make_near_misses.py (370 pairs; the guard was written after seeing them, so
they do not test it fairly). bench/data/routing_near_misses_heldout.jsonl holds 60 pairs written by
hand by another author after the guard was fixed (lowercase words that flip the answer, the guard's
stated blind spot, numbers and units, polarity, entities, tasks); its negations were then used to
extend the guard. `--heldout` measures bench/data/heldout/ (near_misses.jsonl and paraphrases.jsonl,
written by hand by another engineer who did not read the guard: bench/heldout.py), all of it or one
half of its fixed seeded split (`--half dev` to develop on, `--half test` only ever to report).
The default paraphrases are the 20 of bench/data/routing_cache_pairs.jsonl. For each threshold it
compares a plain semantic cache (cosine >= threshold: what a threshold alone gives) with kaon's (the
same, plus the near-miss guard of operator/kaon_operator/routes/anchors.py, which the router applies)
and prints the false-hit rates, their ratio and the exact one-sided 95% upper bound of kaon's rate, and
the paraphrase hit rates. The decision per pair is the router's: MemoryStore.nearest's cosine of the
unit vectors, then anchors.accepts (the guard's verdict, and the cut-off for it: `threshold` for prompts
in other words, min(threshold, sameWordsThreshold) for prompts with the same content words). The
previous guard (bench/guard_routes3.py: one threshold, names with their case and in order) is measured
beside it. `--show N` lists up to N pairs that passed (and paraphrases refused) at the default threshold:
never with `--half test`.
"""
from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for part in ("runtime", "operator"):
    sys.path.insert(0, str(ROOT / part))

import guard_routes3  # noqa: E402
from heldout import field, load, split, upper_bound  # noqa: E402

from kaon_operator.routes import anchors  # noqa: E402
from kaon_operator.routes.api import SemanticCacheSpec  # noqa: E402
from kaon_operator.routes.memory_store import cosine_of_units, unit  # noqa: E402
from kaon_runtime.server.route_train import encoder_embed  # noqa: E402

THRESHOLDS = (0.85, 0.88, 0.90, 0.92, 0.95)


def similarities(embed, pairs: list[tuple[str, str]]) -> list[float]:
    texts = sorted({t for pair in pairs for t in pair})
    vectors = dict(zip(texts, embed(texts), strict=True))
    return [cosine_of_units(unit(vectors[a]), unit(vectors[b])) for a, b in pairs]


def near_pair(row: dict) -> tuple[str, str]:
    """(the new request, the cached one)."""
    return (field(row, "near_miss", "b", "question_b", "second", "q2", "variant"),
            field(row, "prompt", "a", "question_a", "first", "q1", "question", "original"))


def paraphrase_pair(row: dict) -> tuple[str, str]:
    return (field(row, "paraphrase", "b", "question_b", "second", "q2", "variant"),
            field(row, "prompt", "a", "question_a", "first", "q1", "question", "original"))


def kind(row: dict) -> str:
    for name in ("kind", "category", "type"):
        if name in row:
            return str(row[name])
    return "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--embedder", default="builtin://all-minilm-l6-v2")
    parser.add_argument("--near-misses", default="routing_near_misses.jsonl", help="a file, or a name in bench/data/")
    parser.add_argument("--paraphrases", default="routing_cache_pairs.jsonl", help="a file, or a name in bench/data/")
    parser.add_argument("--heldout", action="store_true", help="bench/data/heldout/'s near_misses.jsonl and "
                        "paraphrases.jsonl instead")
    parser.add_argument("--heldout2", action="store_true", help="bench/data/heldout2/'s near_misses.jsonl and "
                        "paraphrases.jsonl (the second held-out set: measured whole, never with --show)")
    parser.add_argument("--half", choices=("all", "dev", "test"), default="all",
                        help="the whole set, or one half of its fixed seeded split (bench/heldout.py)")
    parser.add_argument("--same-words-threshold", type=float, default=SemanticCacheSpec().same_words_threshold,
                        help="cache.semantic.sameWordsThreshold (default: the CRD's)")
    parser.add_argument("--show", type=int, default=0, help="list up to N pairs that passed at the default")
    args = parser.parse_args()
    if args.heldout:
        args.near_misses, args.paraphrases = "heldout/near_misses.jsonl", "heldout/paraphrases.jsonl"
    if args.heldout2:
        args.near_misses, args.paraphrases = "heldout2/near_misses.jsonl", "heldout2/paraphrases.jsonl"
        if args.show:
            parser.error("--heldout2 is held out: --show would print its pairs")
    near, para = load(args.near_misses), load(args.paraphrases)
    if args.half != "all":
        near = split(near, kind)[args.half == "test"]
        para = split(para, kind)[args.half == "test"]
        print(f"half {args.half} of the fixed split (bench/heldout.py, seed 52, stratified by kind)")
    started = time.monotonic()
    embed = encoder_embed(args.embedder)
    near_pairs = [near_pair(r) for r in near]
    para_pairs = [paraphrase_pair(r) for r in para]
    near_cos, para_cos = similarities(embed, near_pairs), similarities(embed, para_pairs)
    print(f"{len(near)} near-miss pairs, {len(para)} paraphrase pairs; embedded in "
          f"{time.monotonic() - started:.0f} s ({args.embedder}, kaon's encoder, CPU)")
    guard_near = [anchors.may_match(a, b) for a, b in near_pairs]
    guard_para = [anchors.may_match(a, b) for a, b in para_pairs]
    default, same_words = SemanticCacheSpec().threshold, args.same_words_threshold

    def hits(pairs: list[tuple[str, str]], cosines: list[float], t: float) -> list[bool]:
        """The router's decision (anchors.accepts) for each pair at threshold t."""
        return [anchors.accepts(a, b, c, t, same_words) for (a, b), c in zip(pairs, cosines, strict=True)]

    before_near = [guard_routes3.may_match(a, b) for a, b in near_pairs]
    before_para = [guard_routes3.may_match(a, b) for a, b in para_pairs]
    for t in THRESHOLDS:
        plain = sum(c >= t for c in near_cos)
        near_hits = hits(near_pairs, near_cos, t)
        kaon = sum(near_hits)
        before = sum(c >= t and g for c, g in zip(near_cos, before_near, strict=True))
        para_plain = sum(c >= t for c in para_cos)
        para_kaon = sum(hits(para_pairs, para_cos, t))
        para_before = sum(c >= t and g for c, g in zip(para_cos, before_para, strict=True))
        kinds = collections.Counter(kind(r) for r, h in zip(near, near_hits, strict=True) if h)
        ratio = f"{kaon / plain:.3f}" if plain else "n/a"
        mark = " (the CRD's default)" if abs(t - default) < 1e-9 else ""
        print(f"threshold {t:.2f}{mark}: false hits threshold alone {plain}/{len(near)} "
              f"({plain / len(near):.1%}); kaon (threshold + guard) {kaon}/{len(near)} ({kaon / len(near):.2%}, "
              f"95% upper bound {upper_bound(kaon, len(near)):.2%}){' ' + str(dict(kinds)) if kinds else ''}; "
              f"ratio {ratio}; previous guard {before}/{len(near)}; "
              f"paraphrase hits {para_plain}/{len(para)} alone, {para_kaon}/{len(para)} with the guard "
              f"({para_kaon / len(para):.1%}; previous guard {para_before}/{len(para)}, "
              f"ratio {para_kaon / max(1, para_before):.2f})")
    print(f"cosine: near misses mean {sum(near_cos) / len(near_cos):.3f} (max {max(near_cos):.3f}); "
          f"paraphrases mean {sum(para_cos) / len(para_cos):.3f} (min {min(para_cos):.3f})")
    print(f"guard alone refuses {guard_near.count(False)}/{len(near)} near misses and "
          f"{guard_para.count(False)}/{len(para)} paraphrases")
    for name, pairs in (("near misses", near_pairs), ("paraphrases", para_pairs)):
        verdicts = collections.Counter(anchors.verdict(a, b) for a, b in pairs)
        print(f"verdicts, {name}: " + ", ".join(f"{v} {verdicts[v]}" for v in
                                                 (anchors.SAME_WORDS, anchors.REWORDED, anchors.REFUSED)))
    print(f"(sameWordsThreshold {same_words}: a same-words pair hits at min(threshold, {same_words}))")
    pairs = near_pairs + para_pairs
    started = time.perf_counter()
    for _ in range(5):
        for a, b in pairs:
            anchors.verdict(a, b)
    per_pair = (time.perf_counter() - started) / (5 * len(pairs))
    print(f"the guard's verdict takes {per_pair * 1e6:.0f} us a pair (mean over {len(pairs)} pairs, 5 rounds; "
          f"the router calls it once a request whose nearest cached prompt is close)")
    if args.show:
        at_default = hits(near_pairs, near_cos, default)
        passed = [(c, p) for c, h, p in zip(near_cos, at_default, near_pairs, strict=True) if h]
        for c, (a, b) in sorted(passed, reverse=True)[: args.show]:
            print(f"  false hit at {c:.3f}: {b!r} / {a!r}")
        lost = [(c, p) for c, g, p in zip(para_cos, guard_para, para_pairs, strict=True) if c >= default and not g]
        for c, (a, b) in sorted(lost, reverse=True)[: args.show]:
            print(f"  paraphrase refused by the guard at {c:.3f}: {b!r} / {a!r}")


if __name__ == "__main__":
    main()
