"""`kaon route train examples.jsonl`: the InferenceRoute's learned classifier.

Each line of the examples file is {"prompt": "..."} or {"messages": [...]} (an OpenAI chat request's
messages) with "tier": a tier's index (0 the cheapest) or its service name. The prompts are embedded
with a sentence encoder served by kaon's own encoder engine (all-MiniLM-L6-v2 by default, the same
vectors the route's embedder service returns), L2-normalized, and a multinomial logistic regression
(softmax, L2-regularized, full-batch gradient descent in numpy) is fitted on them. The JSON written is
the route's spec.classifier.learned.model (operator/kaon_operator/routes/api.py: LearnedModel); the
router scores it in plain Python (routes/learned.py).
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kaon_runtime.errors import KaonError
from kaon_wire import content_text

FORMAT = "kaon.route-classifier/v1"
DEFAULT_EMBEDDER = "builtin://all-minilm-l6-v2"


class ExamplesError(ValueError):
    """The examples file is not usable; the message names the line."""


@dataclass(frozen=True)
class Example:
    text: str
    label: str  # a tier index as a string ("0") or a service name


def prompt_text(example: dict) -> str:
    """The text the router classifies: a prompt as is; chat messages' text parts joined by newlines, all
    roles (the same join as operator/kaon_operator/routes/classifier.py's prompt_text)."""
    if "messages" in example:
        messages = example["messages"]
        if not isinstance(messages, list):
            raise ValueError('"messages" must be a list of chat messages')
        return "\n".join(content_text(m.get("content")) for m in messages if isinstance(m, dict))
    prompt = example.get("prompt")
    if not isinstance(prompt, str):
        raise ValueError('each example needs "prompt" (a string) or "messages"')
    return prompt


def parse_examples(lines: list[str]) -> list[Example]:
    out = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if not isinstance(row, dict):
                raise ValueError("a line must be a JSON object")
            text = prompt_text(row)
            tier = row.get("tier")
            valid = (isinstance(tier, int) and tier >= 0) or (isinstance(tier, str) and bool(tier))
            if isinstance(tier, bool) or not valid:
                raise ValueError('"tier" must be a tier index (0, 1, ...) or a tier\'s service name')
        except ValueError as exc:
            raise ExamplesError(f"line {number}: {exc}") from None
        out.append(Example(text, str(tier)))
    labels = {e.label for e in out}
    if len(labels) < 2:
        raise ExamplesError(f"the examples name {len(labels)} tier(s): a classifier needs examples of at least two")
    return out


def split(examples: list[Example], test_fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A stratified split: `test_fraction` of each class held out (at least one when the fraction is > 0)."""
    if test_fraction <= 0:
        return examples, []
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in sorted({e.label for e in examples}):
        rows = [e for e in examples if e.label == label]
        order = rng.permutation(len(rows))
        held = max(1, round(len(rows) * test_fraction)) if len(rows) > 1 else 0
        test += [rows[i] for i in order[:held]]
        train += [rows[i] for i in order[held:]]
    return train, test


def normalize_rows(x: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.where(norms == 0, 1.0, norms)


def fit(x: np.ndarray, labels: list[str], l2: float = 1e-3, steps: int = 2000,
        learning_rate: float = 2.0) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Softmax regression on the rows of `x` (already normalized): (classes, weights [K, D], bias [K]).
    Classes are sorted (indices numerically) so that the same file gives the same model."""
    classes = sorted(set(labels), key=lambda c: (not c.isdigit(), int(c) if c.isdigit() else 0, c))
    index = {c: k for k, c in enumerate(classes)}
    y = np.zeros((len(labels), len(classes)))
    y[np.arange(len(labels)), [index[c] for c in labels]] = 1.0
    weights = np.zeros((len(classes), x.shape[1]))
    bias = np.zeros(len(classes))
    n = len(labels)
    for _ in range(steps):
        logits = x @ weights.T + bias
        logits -= logits.max(axis=1, keepdims=True)
        p = np.exp(logits)
        p /= p.sum(axis=1, keepdims=True)
        error = (p - y) / n
        weights -= learning_rate * (error.T @ x + l2 * weights)
        bias -= learning_rate * error.sum(axis=0)
    return classes, weights, bias


def predict(model: dict, x: np.ndarray) -> list[str]:
    """The class of each row of `x` under a written model (the router's rule: highest score wins)."""
    weights = np.asarray(model["weights"], dtype=np.float64)
    if x.shape[1] != model["dimension"]:
        raise ValueError(f"embeddings of dimension {x.shape[1]} given to a model of dimension {model['dimension']} "
                         f"({model['embedder']}): embed with the model's encoder or retrain")
    if model["normalize"]:
        x = normalize_rows(x)
    scores = x @ weights.T + np.asarray(model["bias"])
    return [model["classes"][k] for k in scores.argmax(axis=1)]


def model_json(embedder: str, classes: list[str], weights: np.ndarray, bias: np.ndarray, examples: int) -> dict:
    return {"format": FORMAT, "embedder": embedder, "dimension": int(weights.shape[1]), "normalize": True,
            "classes": classes, "weights": [[round(float(w), 7) for w in row] for row in weights],
            "bias": [round(float(b), 7) for b in bias], "examples": examples}


def accuracy(model: dict, x: np.ndarray, labels: list[str]) -> float:
    return float(np.mean([p == t for p, t in zip(predict(model, x), labels)])) if labels else float("nan")


def embedder_name(model: str) -> str:
    return model.removeprefix("builtin://").rstrip("/").rsplit("/", 1)[-1]


def train(examples: list[Example], embed, embedder: str, test_fraction: float = 0.0, seed: int = 0,
          l2: float = 1e-3) -> tuple[dict, float, float]:
    """(model, train accuracy, held-out accuracy or nan). `embed(texts) -> [[float]]` is the encoder."""
    train_set, test_set = split(examples, test_fraction, seed)
    x = normalize_rows(np.asarray(embed([e.text for e in train_set]), dtype=np.float64))
    classes, weights, bias = fit(x, [e.label for e in train_set], l2=l2)
    model = model_json(embedder, classes, weights, bias, len(train_set))
    train_accuracy = accuracy(model, x, [e.label for e in train_set])
    test_accuracy = float("nan")
    if test_set:
        x_test = np.asarray(embed([e.text for e in test_set]), dtype=np.float64)
        test_accuracy = accuracy(model, x_test, [e.label for e in test_set])
    return model, train_accuracy, test_accuracy


@functools.cache
def _encoder(root: Path):
    from kaon_runtime.engine.encoder import EncoderEngine  # torch is loaded only when embedding

    return EncoderEngine(root)


def encoder_embed(model: str):
    """The encoder engine's embed over a list of texts (vectors as the checkpoint's config says); the
    engine is loaded once per process (the bench and tests embed several times)."""
    from kaon_runtime.loader.resolve import resolve_model
    from kaon_runtime.models.bert import is_encoder_checkpoint

    root = resolve_model(model)
    if not (root.is_dir() and is_encoder_checkpoint(root)):
        raise ExamplesError(f"{model} is not a sentence encoder (a BERT-family checkpoint) kaon can run")
    engine = _encoder(root)
    return lambda texts: [vector for vector, _ in engine.embed(list(texts))]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kaon route", description="InferenceRoute tools")
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="fit the learned classifier on labelled prompts (JSON lines)")
    t.add_argument("examples", type=Path, help='JSON lines: {"prompt" or "messages", "tier": index or service}')
    t.add_argument("-o", "--output", type=Path, default=Path("route-classifier.json"))
    t.add_argument("--embedder", default=DEFAULT_EMBEDDER, help="the sentence encoder (the route's embedder "
                   "service must serve the same one)")
    t.add_argument("--test-fraction", type=float, default=0.0, help="hold out this share of each tier's "
                   "examples and report the accuracy on them (the model is fitted on the rest)")
    t.add_argument("--l2", type=float, default=1e-3, help="weight decay")
    t.add_argument("--seed", type=int, default=0)
    return parser


def run_cli(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if not 0 <= args.test_fraction < 1:
        print("kaon route train: error: --test-fraction must lie in [0, 1)", file=sys.stderr)
        return 2
    try:
        examples = parse_examples(args.examples.read_text().splitlines())
        model, train_accuracy, test_accuracy = train(examples, encoder_embed(args.embedder),
                                                     embedder_name(args.embedder), args.test_fraction, args.seed,
                                                     args.l2)
    except (OSError, ExamplesError, KaonError) as exc:  # a bad file or model: one line, no traceback
        print(f"kaon route train: error: {exc}", file=sys.stderr)
        return 2
    args.output.write_text(json.dumps(model) + "\n")
    held = f", held-out accuracy {test_accuracy:.1%}" if test_accuracy == test_accuracy else ""
    print(f"wrote {args.output}: {len(model['classes'])} classes {model['classes']}, {model['dimension']}-d "
          f"{model['embedder']} embeddings, {model['examples']} examples, train accuracy {train_accuracy:.1%}{held}")
    return 0
