"""The learned classifier on the router's side: the model's validation (shapes, classes naming tiers), the
pure scoring (routes/learned.py), and through the real router against fake engines: the tier the model
picks from the embedder's vector, and the counted fallback to the rule set when the embedder is missing or
answers another dimension."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from kaon_operator.router.route_gateway import CACHE_HEADER, TIER_HEADER
from kaon_operator.routes import learned
from kaon_operator.routes.api import InferenceRouteSpec, LearnedModel
from support.router import NS, metric, run, serving
from unit.operator.routes.test_routes_router import chat, engines, route_object, routed, stop

# The fake embedder's vocabulary (test_routes_router.Engine): a bag of words over these 10.
VOCAB = ["capital", "france", "of", "what", "is", "the", "city", "main", "germany", "which"]


def model(dimension: int = 2, classes=("0", "1"), weights=((1.0, 0.0), (0.0, 1.0)), bias=(0.0, 0.0), **extra):
    return {"embedder": "toy", "dimension": dimension, "classes": list(classes),
            "weights": [list(r) for r in weights], "bias": list(bias), **extra}


def test_scores_are_a_dot_product_plus_bias_on_the_normalized_vector():
    m = LearnedModel.model_validate(model(weights=((2.0, -1.0), (0.5, 3.0)), bias=(0.25, -0.5)))
    # [3, 4] normalized is [0.6, 0.8]
    assert learned.scores(m, [3.0, 4.0]) == pytest.approx([2 * 0.6 - 0.8 + 0.25, 0.5 * 0.6 + 3 * 0.8 - 0.5])
    raw = LearnedModel.model_validate(model(weights=((2.0, -1.0), (0.5, 3.0)), bias=(0.25, -0.5), normalize=False))
    assert learned.scores(raw, [3.0, 4.0]) == pytest.approx([2.25, 13.0])


def test_decide_picks_the_highest_class_and_maps_it_to_its_tier():
    m = LearnedModel.model_validate(model(classes=("large", "small")))
    services = ["small", "large"]
    first = learned.decide(m, [5.0, 1.0], services)
    assert (first.label, first.tier, first.request_class) == ("large", 1, "learned/large")
    assert first.probability > 0.5
    second = learned.decide(m, [1.0, 5.0], services)
    assert (second.label, second.tier) == ("small", 0)
    by_index = LearnedModel.model_validate(model())
    assert learned.decide(by_index, [0.1, 9.0], services).tier == 1


def test_a_vector_of_another_dimension_is_refused_clearly():
    m = LearnedModel.model_validate(model())
    with pytest.raises(learned.DimensionMismatch, match="returned 3 values but the classifier was trained on "
                                                        "2-dimensional toy embeddings"):
        learned.scores(m, [1.0, 2.0, 3.0])


def test_a_model_whose_weights_do_not_match_its_dimension_is_refused():
    with pytest.raises(ValidationError, match="weights row 1 has 3 values but the model's dimension is 2"):
        LearnedModel.model_validate(model(weights=((1.0, 0.0), (0.0, 1.0, 2.0))))
    with pytest.raises(ValidationError, match="2 classes, 2 weight rows and 3 biases"):
        LearnedModel.model_validate(model(bias=(0.0, 0.0, 1.0)))


def test_the_spec_checks_classes_name_tiers_and_learned_mode_has_a_model():
    tiers = [{"service": "small", "costPerMillionTokens": 0.1}, {"service": "large", "costPerMillionTokens": 1.0}]
    ok = {"mode": "learned", "learned": {"embedder": "minilm", "model": model(classes=("small", "1"))}}
    assert InferenceRouteSpec.model_validate({"tiers": tiers, "classifier": ok}).classifier.learned is not None
    bad = {"mode": "learned", "learned": {"embedder": "minilm", "model": model(classes=("small", "2"))}}
    with pytest.raises(ValidationError, match="class '2' names no tier"):
        InferenceRouteSpec.model_validate({"tiers": tiers, "classifier": bad})
    with pytest.raises(ValidationError, match=r"needs classifier\.learned"):
        InferenceRouteSpec.model_validate({"tiers": tiers, "classifier": {"mode": "learned"}})


# Sends prompts mentioning Germany to the large tier, the rest to the small one (the rule set would send
# all of these short questions to the small tier).
GERMANY = model(dimension=len(VOCAB), classes=("small", "large"),
                weights=([0.0] * len(VOCAB), [5.0 if w == "germany" else 0.0 for w in VOCAB]), bias=(1.0, 0.0))


def learned_route(embedder: str = "embed", learned_model: dict | None = None) -> dict:
    return route_object(classifier={"mode": "learned",
                                    "learned": {"embedder": embedder, "model": learned_model or GERMANY}})


def test_the_router_routes_by_the_learned_model():
    async def main():
        found = await engines("small", "large", "embed")
        router = routed(found, learned_route())
        async with serving(router) as client:
            async with client.post("/v1/chat/completions", json=chat("What is the capital of Germany?")) as r:
                assert r.status == 200 and r.headers[TIER_HEADER] == "large"
            async with client.post("/v1/chat/completions", json=chat("What is the capital of France?")) as r:
                assert r.status == 200 and r.headers[TIER_HEADER] == "small"
            assert found["embed"].calls == 2
        await stop(found)
    run(main())


def test_the_semantic_cache_reuses_the_classifiers_embedding():
    async def main():
        found = await engines("small", "large", "embed")
        route = learned_route()
        route["spec"]["cache"] = {"semantic": {"enabled": True, "embedder": "embed", "threshold": 0.85}}
        router = routed(found, route)
        async with serving(router) as client:
            async with client.post("/v1/chat/completions",
                                   json=chat("What is the capital of Germany?", temperature=0)) as r:
                assert r.headers[TIER_HEADER] == "large" and r.headers[CACHE_HEADER] == "miss"
            async with client.post("/v1/chat/completions",
                                   json=chat("Tell me, what is the capital of Germany?", temperature=0)) as r:
                assert r.headers[CACHE_HEADER] == "hit"
            assert found["embed"].calls == 2  # one embedding per request, shared by classifier and cache
        await stop(found)
    run(main())


def test_the_rule_set_decides_counted_when_the_embedder_is_missing_or_of_another_dimension():
    async def main():
        found = await engines("small", "large", "embed")
        wrong_dim = {**GERMANY, "dimension": 3, "weights": [[0.0] * 3, [1.0] * 3]}
        router = routed(found, learned_route(embedder="nothing"),
                        {**learned_route(learned_model=wrong_dim), "metadata": {"name": "other", "namespace": NS}})
        async with serving(router) as client:
            async with client.post("/v1/chat/completions", json=chat("What is the capital of Germany?")) as r:
                assert r.status == 200 and r.headers[TIER_HEADER] == "small"  # the rules: a short question
            async with client.post("/v1/chat/completions",
                                   json=chat("What is the capital of Germany?", model="other")) as r:
                assert r.status == 200 and r.headers[TIER_HEADER] == "small"
            async with client.get("/metrics") as r:
                text = await r.text()
            assert metric(text, "kaon_route_classifier_fallbacks_total", namespace=NS, inferenceroute="assistant",
                          reason="embedder_unreachable") == 1
            assert metric(text, "kaon_route_classifier_fallbacks_total", namespace=NS, inferenceroute="other",
                          reason="dimension_mismatch") == 1
        await stop(found)
    run(main())
