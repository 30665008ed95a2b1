"""Calibrate the quality monitor's verify.similarity on labelled pairs of long answers.

    .venv/bin/python bench/monitor_similarity.py [--pairs heldout/answer_pairs.jsonl]
        [--embedder builtin://all-minilm-l6-v2] [--seed 52] [--dev-only]
    .venv/bin/python bench/monitor_similarity.py --pairs heldout2/answer_pairs.jsonl --whole

The monitor (operator/kaon_operator/routes/monitor.py: agree) says a lower tier's long answer agrees
with the top tier's when their facts agree and the cosine of the two answers' embeddings is at least
verify.similarity (default 0.77; 0.8 before the facts were compared); answers of at most 12 words are
compared word for word instead, and without an embedder long ones by word-set overlap (Jaccard >= 0.5).
Each pair of the file is two answers to one question, labelled agree (the same answer in other words) or
disagree (another answer). The embeddings are the real all-MiniLM-L6-v2's through kaon's encoder, in
process: the vectors the route's embedder service returns.

Since routes4 the monitor compares the answers' facts first
(operator/kaon_operator/routes/answer_facts.py: one text edited whose edits change a number, name,
negation or code; numbers that conflict) and the cosine only when they do not tell; the bench measures
that and, beside it, the cosine alone (as before).

The pairs are split by a fixed seed into halves, stratified by label (bench/heldout.py): the threshold
is chosen on the dev half only (the best accuracy; ties: the middle of the best range), and the test
half reports it beside the CRD's default and the word-overlap fallback, each as the monitor decides
(short pairs word for word). Prints the accuracy per threshold on each half."""
from __future__ import annotations

import argparse
import collections
import itertools
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for part in ("runtime", "operator"):
    sys.path.insert(0, str(ROOT / part))

from heldout import field, load, split  # noqa: E402

from kaon_operator.routes import monitor  # noqa: E402
from kaon_operator.routes.api import VerifySpec  # noqa: E402
from kaon_runtime.server.route_train import encoder_embed  # noqa: E402

GRID = tuple(round(0.50 + 0.05 * i, 2) for i in range(10))  # 0.50 .. 0.95
AGREE, DISAGREE = "agree", "disagree"
BEFORE = 0.8  # verify.similarity's default before the facts were compared (routes3)


def label(row: dict) -> bool:
    """True for a pair that agrees."""
    value = field(row, "label", "agree", "agrees", "same")
    if isinstance(value, str):
        if value.strip().lower() not in (AGREE, DISAGREE):
            raise ValueError(f"label {value!r}: expected {AGREE!r} or {DISAGREE!r}")
        return value.strip().lower() == AGREE
    return bool(value)


def answers(row: dict) -> tuple[str, str]:
    return (field(row, "a", "answer_a", "answer", "first", "left", "text_a", "answer1"),
            field(row, "b", "answer_b", "reference", "second", "right", "text_b", "answer2"))


def decide(a: str, b: str, cosine: float | None, threshold: float) -> bool:
    """The monitor's decision: word for word when short; else the facts (answer_facts.py), then
    cosine >= threshold (None: word overlap)."""
    return monitor.agree(a, b, cosine, threshold)


def cosine_only(a: str, b: str, cosine: float | None, threshold: float) -> bool:
    """The monitor's decision before the facts were compared (routes3): word for word when short, else
    cosine >= threshold."""
    if cosine is not None and monitor.is_long(a, b):
        return cosine >= threshold
    return monitor.agree(a, b, cosine, threshold)


def accuracy(rows: list[dict], cosines: dict[int, float | None], threshold: float,
             use_embedding: bool = True, how=decide) -> tuple[int, int, int, int]:
    """(right, n, agreeing pairs judged disagree, disagreeing pairs judged agree)."""
    right = missed = passed = 0
    for row in rows:
        a, b = answers(row)
        said = how(a, b, cosines[id(row)] if use_embedding else None, threshold)
        truth = label(row)
        right += said == truth
        missed += truth and not said
        passed += said and not truth
    return right, len(rows), missed, passed


def choose(rows: list[dict], cosines: dict[int, float | None], how=decide) -> float:
    """The threshold with the best accuracy on `rows` (only long pairs depend on it): every midpoint
    between two neighbouring cosines is a candidate; ties: the middle one of the best."""
    values = sorted({c for c in (cosines[id(r)] for r in rows) if c is not None})
    candidates = [(x + y) / 2 for x, y in itertools.pairwise(values)] or [monitor.EMBEDDING_SIMILARITY]
    scored = [(accuracy(rows, cosines, t, how=how)[0], t) for t in candidates]
    best = max(s for s, _ in scored)
    ties = [t for s, t in scored if s == best]
    return ties[len(ties) // 2]


def line(name: str, rows: list[dict], cosines: dict[int, float | None], threshold: float,
         use_embedding: bool = True, how=decide) -> str:
    right, n, missed, passed = accuracy(rows, cosines, threshold, use_embedding, how)
    agree_n = sum(label(r) for r in rows)
    return (f"{name}: {right}/{n} = {right / n:.1%} (agreeing pairs judged disagree {missed}/{agree_n}, "
            f"disagreeing judged agree {passed}/{n - agree_n})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="heldout/answer_pairs.jsonl", help="a file, or a name in bench/data/")
    parser.add_argument("--embedder", default="builtin://all-minilm-l6-v2")
    parser.add_argument("--seed", type=int, default=52)
    parser.add_argument("--whole", action="store_true", help="a held-out file measured whole at the CRD's "
                        "default (no threshold chosen on it), e.g. --pairs heldout2/answer_pairs.jsonl --whole")
    parser.add_argument("--dev-only", action="store_true", help="print the dev half's figures only (to develop on)")
    args = parser.parse_args()
    rows = load(args.pairs)
    started = time.monotonic()
    embed = encoder_embed(args.embedder)
    long_rows = [r for r in rows if monitor.is_long(*answers(r))]
    texts = sorted({t for r in long_rows for t in answers(r)})
    vectors = dict(zip(texts, embed(texts), strict=True)) if texts else {}
    cosines: dict[int, float | None] = {id(r): None for r in rows}
    for r in long_rows:
        a, b = answers(r)
        cosines[id(r)] = monitor.cosine(vectors[a], vectors[b])
    if args.whole:
        default = VerifySpec().similarity
        deciders = collections.Counter(monitor.compare(*answers(r), cosines[id(r)], default)[1] for r in rows)
        print(f"{len(rows)} answer pairs ({sum(map(label, rows))} agree), measured whole; embedded in "
              f"{time.monotonic() - started:.0f} s ({args.embedder}); what decided: {dict(deciders)}")
        print(line(f"facts + cosine, default {default:.2f}", rows, cosines, default))
        print(line("facts + word overlap (no embedder)", rows, cosines, default, use_embedding=False))
        print(line(f"cosine alone as before (its default {BEFORE:.2f})", rows, cosines, BEFORE, how=cosine_only))
        right, before = accuracy(rows, cosines, default)[0], accuracy(rows, cosines, BEFORE, how=cosine_only)[0]
        print(f"ratio (facts + cosine) / (cosine alone as before): {right / max(1, before):.3f}")
        return
    dev, test = split(rows, label, seed=args.seed)
    if args.dev_only:
        rows, long_rows, test = dev, [r for r in long_rows if r in dev], dev
        print("--dev-only: every figure below is the dev half's (\"test\" reads dev)")
    print(f"{len(rows)} answer pairs ({sum(map(label, rows))} agree), {len(long_rows)} long (compared by "
          f"embeddings; the rest word for word); embedded in {time.monotonic() - started:.0f} s ({args.embedder}, "
          f"kaon's encoder, CPU); split (seed {args.seed}, by label): dev {len(dev)}, test {len(test)}")
    for name, wanted in (("agree", True), ("disagree", False)):
        cs = sorted(cosines[id(r)] or 0.0 for r in long_rows if label(r) == wanted)
        if cs:
            print(f"cosine, long {name} pairs: min {cs[0]:.3f}, median {cs[len(cs) // 2]:.3f}, max {cs[-1]:.3f}")
    for t in GRID:
        mark = " (the CRD's default)" if abs(t - VerifySpec().similarity) < 1e-9 else ""
        print(f"threshold {t:.2f}{mark}: " + "; ".join(
            f"{name} {accuracy(half, cosines, t)[0]}/{len(half)} = {accuracy(half, cosines, t)[0] / len(half):.1%}"
            for name, half in (("dev", dev), ("test", test))))
    chosen = choose(dev, cosines)
    default = VerifySpec().similarity
    deciders = collections.Counter(monitor.compare(*answers(r), cosines[id(r)], default)[1] for r in test)
    print(f"chosen on dev: {chosen:.3f}; what decided on the test half at the default: {dict(deciders)}")
    print(line(f"test, chosen {chosen:.3f}", test, cosines, chosen))
    print(line(f"test, default {default:.2f}", test, cosines, default))
    print(line("test, word overlap (no embedder)", test, cosines, default, use_embedding=False))
    before = choose(dev, cosines, cosine_only)
    print(line(f"test, cosine alone as before (chosen on dev {before:.3f})", test, cosines, before, how=cosine_only))
    print(line(f"test, cosine alone as before (its default {BEFORE:.2f})", test, cosines, BEFORE, how=cosine_only))
    right_chosen = accuracy(test, cosines, chosen)[0]
    right_default = accuracy(test, cosines, default)[0]
    right_before = accuracy(test, cosines, BEFORE, how=cosine_only)[0]
    print(f"ratio (test accuracy, chosen / default): {right_chosen / max(1, right_default):.3f}; "
          f"(facts + cosine) / (cosine alone as before), each at its default: "
          f"{right_default / max(1, right_before):.3f}")

if __name__ == "__main__":
    main()
