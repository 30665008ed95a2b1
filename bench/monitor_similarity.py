"""Calibrate the quality monitor's verify.similarity on labelled pairs of long answers.

    .venv/bin/python bench/monitor_similarity.py [--pairs heldout/answer_pairs.jsonl]
        [--embedder builtin://all-minilm-l6-v2] [--seed 52]

The monitor (operator/kaon_operator/routes/monitor.py: agree) says a lower tier's long answer agrees with
the top tier's when the cosine of the two answers' embeddings is at least verify.similarity (default
0.8); answers of at most 12 words are compared word for word instead, and without an embedder long ones
by word-set overlap (Jaccard >= 0.5). Each pair of the file is two answers to one question, labelled
agree (the same answer in other words) or disagree (another answer). The embeddings are the real
all-MiniLM-L6-v2's through kaon's encoder, in process: the vectors the route's embedder service returns.

The pairs are split by a fixed seed into halves, stratified by label (bench/heldout.py): the threshold
is chosen on the dev half only (the best accuracy; ties: the middle of the best range), and the test
half reports it beside the default 0.8 and the word-overlap fallback, each as the monitor decides (short
pairs word for word). Prints the accuracy per threshold on each half.
"""
from __future__ import annotations

import argparse
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
    """The monitor's decision: word for word when short, else cosine >= threshold (None: word overlap)."""
    return monitor.agree(a, b, cosine, threshold)


def accuracy(rows: list[dict], cosines: dict[int, float | None], threshold: float,
             use_embedding: bool = True) -> tuple[int, int, int, int]:
    """(right, n, agreeing pairs judged disagree, disagreeing pairs judged agree)."""
    right = missed = passed = 0
    for row in rows:
        a, b = answers(row)
        said = decide(a, b, cosines[id(row)] if use_embedding else None, threshold)
        truth = label(row)
        right += said == truth
        missed += truth and not said
        passed += said and not truth
    return right, len(rows), missed, passed


def choose(rows: list[dict], cosines: dict[int, float | None]) -> float:
    """The threshold with the best accuracy on `rows` (only long pairs depend on it): every midpoint
    between two neighbouring cosines is a candidate; ties: the middle one of the best."""
    values = sorted({c for c in (cosines[id(r)] for r in rows) if c is not None})
    candidates = [(x + y) / 2 for x, y in itertools.pairwise(values)] or [monitor.EMBEDDING_SIMILARITY]
    scored = [(accuracy(rows, cosines, t)[0], t) for t in candidates]
    best = max(s for s, _ in scored)
    ties = [t for s, t in scored if s == best]
    return ties[len(ties) // 2]


def line(name: str, rows: list[dict], cosines: dict[int, float | None], threshold: float,
         use_embedding: bool = True) -> str:
    right, n, missed, passed = accuracy(rows, cosines, threshold, use_embedding)
    agree_n = sum(label(r) for r in rows)
    return (f"{name}: {right}/{n} = {right / n:.1%} (agreeing pairs judged disagree {missed}/{agree_n}, "
            f"disagreeing judged agree {passed}/{n - agree_n})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", default="heldout/answer_pairs.jsonl", help="a file, or a name in bench/data/")
    parser.add_argument("--embedder", default="builtin://all-minilm-l6-v2")
    parser.add_argument("--seed", type=int, default=52)
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
    dev, test = split(rows, label, seed=args.seed)
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
    print(f"chosen on dev: {chosen:.3f}")
    print(line(f"test, chosen {chosen:.3f}", test, cosines, chosen))
    print(line(f"test, default {default:.2f}", test, cosines, default))
    print(line("test, word overlap (no embedder)", test, cosines, default, use_embedding=False))
    right_chosen = accuracy(test, cosines, chosen)[0]
    right_default = accuracy(test, cosines, default)[0]
    print(f"ratio (test accuracy, chosen / default): {right_chosen / max(1, right_default):.3f}")


if __name__ == "__main__":
    main()
