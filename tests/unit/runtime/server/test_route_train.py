"""`kaon route train`: the examples file's checks, the softmax regression on a separable toy set, a
model refused on embeddings of another dimension, and the CLI end to end on the real all-MiniLM-L6-v2
(the JSON it writes validates as the route's model and the router's pure scorer agrees with it)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kaon_runtime.cli import main
from kaon_runtime.server import route_train
from kaon_runtime.server.route_train import Example, ExamplesError, parse_examples


def test_examples_accept_prompts_messages_indices_and_names():
    lines = ['{"prompt": "hi", "tier": 0}', "",
             '{"messages": [{"role": "system", "content": "be brief"}, {"role": "user", '
             '"content": [{"type": "text", "text": "compare A and B"}]}], "tier": "large"}']
    assert parse_examples(lines) == [Example("hi", "0"), Example("be brief\ncompare A and B", "large")]


@pytest.mark.parametrize("line, message", [
    ('{"tier": 0}', 'line 1: each example needs "prompt"'),
    ('{"prompt": "x", "tier": -1}', 'line 1: "tier" must be a tier index'),
    ('{"prompt": "x", "tier": true}', 'line 1: "tier" must be a tier index'),
    ("not json", "line 1: Expecting value"),
])
def test_bad_lines_are_refused_with_their_line_number(line, message):
    with pytest.raises(ExamplesError, match=message):
        parse_examples([line, '{"prompt": "y", "tier": 1}'])


def test_one_tier_only_is_refused():
    with pytest.raises(ExamplesError, match="at least two"):
        parse_examples(['{"prompt": "a", "tier": 0}', '{"prompt": "b", "tier": "0"}'])


def toy(n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """Three classes around three directions of a 16-d space, well apart."""
    rng = np.random.default_rng(seed)
    centres = np.eye(16)[:3] * 3.0
    labels = [str(k % 3) for k in range(n)]
    x = np.stack([centres[int(c)] + rng.normal(0, 0.4, 16) for c in labels])
    return x, labels


def test_a_separable_toy_set_is_learned_and_generalizes():
    x, labels = toy(90, seed=1)
    classes, weights, bias = route_train.fit(route_train.normalize_rows(x), labels)
    assert classes == ["0", "1", "2"] and weights.shape == (3, 16)
    model = route_train.model_json("toy", classes, weights, bias, len(labels))
    x_test, labels_test = toy(60, seed=2)
    assert route_train.accuracy(model, x, labels) == 1.0
    assert route_train.accuracy(model, x_test, labels_test) == 1.0


def test_train_holds_out_a_stratified_test_set():
    x, labels = toy(30, seed=3)
    texts = {f"t{i}": x[i] for i in range(len(labels))}
    examples = [Example(f"t{i}", labels[i]) for i in range(len(labels))]
    model, train_acc, test_acc = route_train.train(examples, lambda batch: [texts[t] for t in batch], "toy",
                                                   test_fraction=0.2)
    assert model["examples"] == 24  # 2 of each class's 10 held out
    assert train_acc == 1.0 and test_acc == 1.0


def test_a_model_given_embeddings_of_another_dimension_is_refused():
    x, labels = toy(30, seed=4)
    model = route_train.model_json("toy", *route_train.fit(route_train.normalize_rows(x), labels), len(labels))
    with pytest.raises(ValueError, match="embeddings of dimension 8 given to a model of dimension 16"):
        route_train.predict(model, np.ones((2, 8)))


def test_the_cli_trains_on_real_minilm_embeddings(tmp_path, capsys):
    # ~1.7 s beside other work (loads all-MiniLM-L6-v2 from the package cache): under the 3 s slow mark
    from kaon_operator.routes import learned
    from kaon_operator.routes.api import LearnedModel

    simple = ["What is the capital of France?", "Who wrote Hamlet?", "How many legs does a spider have?",
              "What colour is the sky?", "When did World War II end?", "What is 2 plus 2?"]
    complex_ = ["Analyze step by step the trade-offs between microservices and a monolith for a startup.",
                "Compare three sorting algorithms and explain why their complexity differs, with proofs.",
                "Design a migration plan for a payments database with zero downtime and justify each step.",
                "Evaluate the economic implications of a carbon tax on developing countries in detail.",
                "Walk me through debugging a memory leak in a long-running Python service.",
                "Critique this research design and propose a stronger one with controls and power analysis."]
    lines = [json.dumps({"prompt": p, "tier": "small"}) for p in simple]
    lines += [json.dumps({"messages": [{"role": "user", "content": p}], "tier": 1}) for p in complex_]
    (tmp_path / "examples.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "model.json"
    assert main(["route", "train", str(tmp_path / "examples.jsonl"), "-o", str(out)]) == 0
    assert "train accuracy 100.0%" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert (written["embedder"], written["dimension"], written["classes"]) == ("all-minilm-l6-v2", 384, ["1", "small"])
    model = LearnedModel.model_validate(written)  # what the route's spec accepts
    embed = route_train.encoder_embed(route_train.DEFAULT_EMBEDDER)
    vectors = embed(["What is the capital of Peru?", "Analyze and compare the trade-offs of two cache designs."])
    tiers = [learned.decide(model, v, ["small", "large"]).tier for v in vectors]
    assert tiers == [0, 1]  # unseen prompts, scored by the router's pure-Python path
    assert main(["route", "train", str(tmp_path / "missing.jsonl")]) == 2
    assert main(["route", "train", str(tmp_path / "examples.jsonl"), "--embedder", str(tmp_path / "nothing")]) == 2
    assert "kaon route train: error:" in capsys.readouterr().err
