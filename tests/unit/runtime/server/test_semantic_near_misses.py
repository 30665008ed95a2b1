"""The semantic cache's near-miss guard with the real all-MiniLM-L6-v2 (kaon's encoder): on a sample of
bench/data/routing_near_misses.jsonl (questions that differ in a way that changes the answer), a
threshold alone at the CRD's default lets near misses through; the router's decision (cosine at or
above the default thresholds and the guard's verdict: anchors.accepts) lets none through, while about as many
paraphrases hit as the threshold alone admits. The whole set's figures: bench/semantic_near_misses.py."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from kaon_operator.routes.anchors import accepts
from kaon_operator.routes.api import SemanticCacheSpec
from kaon_operator.routes.memory_store import cosine_of_units, unit
from kaon_runtime.server import route_train

DATA = Path(__file__).resolve().parents[4] / "bench" / "data"


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines() if line.strip()]


@pytest.mark.slow
def test_near_misses_get_no_semantic_hit_at_the_default_threshold():
    # Every 6th pair (62 of 370, each kind of near miss) plus the 20 paraphrases: ~160 short texts.
    near = [(r["near_miss"], r["prompt"]) for r in rows("routing_near_misses.jsonl")[::6]]
    para = [(r["paraphrase"], r["prompt"]) for r in rows("routing_cache_pairs.jsonl")]
    texts = sorted({t for pair in near + para for t in pair})
    vectors = dict(zip(texts, route_train.encoder_embed(route_train.DEFAULT_EMBEDDER)(texts), strict=True))

    spec = SemanticCacheSpec()

    def cosine(a: str, b: str) -> float:
        return cosine_of_units(unit(vectors[a]), unit(vectors[b]))

    def hit(a: str, b: str) -> bool:  # the router's decision
        return accepts(a, b, cosine(a, b), spec.threshold, spec.same_words_threshold)

    by_threshold = [pair for pair in near if cosine(*pair) >= spec.threshold]
    assert len(by_threshold) >= 3, "the sample should hold near misses a threshold alone lets through"
    assert [pair for pair in near if hit(*pair)] == []  # no false hit, at either cut-off
    # The paraphrases: about as many hits as the threshold alone gives (it admits 6 of 20 here; the guard
    # refuses two that change one word, and admits one that only a loose cut-off reaches: same words).
    admitted = [pair for pair in para if cosine(*pair) >= spec.threshold]
    assert admitted and sum(hit(*pair) for pair in para) >= len(admitted) - 1
