"""The held-out sets of bench/data/heldout/ and their fixed, seeded split (used by
bench/semantic_near_misses.py and bench/monitor_similarity.py).

bench/data/heldout/ was written by hand by another engineer (worktree `heldout`) who did not read the
semantic cache's guard (operator/kaon_operator/routes/anchors.py) or the monitor's code:
near_misses.jsonl (questions alike that need different answers: a cache hit between them is a false
hit), paraphrases.jsonl (the same question reworded: should hit), answer_pairs.jsonl (two long answers
labelled agree / disagree: what verify.similarity decides). A figure is held out only while nothing was
tuned on the rows it counts: `split` gives a fixed half for development (dev) and the other half (test),
which is only ever measured, never looked at to change code or a default. The whole set was measured
once with the guard as it was (bench/history/routing_tiers.md, 2026-11-29); the dev half has been read
since, so only the test half is held out now. routes4 developed the next guard and the monitor's fact
comparison on the dev half and measured the test half once at the end (its README's use log); every
further measurement of the test half after a change spends some of its worth: say so with the figure.
bench/data/heldout2/ (a second set, written blind) is measured whole, never split or read.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable, Sequence
from pathlib import Path

HELDOUT = Path(__file__).resolve().parent / "data" / "heldout"
SEED = 52  # the number: fixed, so that the dev half is the same rows in every run


def load(path: Path | str) -> list[dict]:
    """JSON lines; a bare name is looked up in bench/data/ then bench/data/heldout/."""
    path = Path(path)
    if not path.exists():
        for folder in (HELDOUT.parent, HELDOUT):
            if (folder / path).exists():
                path = folder / path
                break
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def split(rows: Sequence[dict], stratum: Callable[[dict], object] = lambda r: None,
          seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """(dev, test): each stratum's rows shuffled by a fixed seed, the first half (rounded down) to dev,
    the rest to test; each half keeps the file's order. The same file always splits the same way."""
    rng = random.Random(seed)
    dev_ids: set[int] = set()
    strata: dict[object, list[int]] = {}
    for i, row in enumerate(rows):
        strata.setdefault(stratum(row), []).append(i)
    for key in sorted(strata, key=repr):
        ids = strata[key]
        rng.shuffle(ids)
        dev_ids.update(ids[: len(ids) // 2])
    return ([r for i, r in enumerate(rows) if i in dev_ids], [r for i, r in enumerate(rows) if i not in dev_ids])


def field(row: dict, *names: str) -> str:
    """The first of `names` the row has (the sets' writers name their fields; a few spellings accepted)."""
    for name in names:
        if name in row:
            return row[name]
    raise KeyError(f"none of {names} in {sorted(row)}")


def upper_bound(hits: int, n: int, confidence: float = 0.95) -> float:
    """Exact (Clopper-Pearson) one-sided upper bound of a rate seen `hits` times in `n`."""
    if hits >= n:
        return 1.0
    from scipy.stats import beta  # scipy comes with sentence-transformers (the test extras)

    return float(beta.ppf(confidence, hits + 1, n - hits))
