"""The learned classifier's decision: a multinomial logistic regression (`kaon route train`) applied to
the prompt's embedding, in plain Python (the router has no numpy; 384 x 2 multiply-adds are microseconds).

Pure: the embedding is fetched by the router (route_gateway.py) from the route's embedder service.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from kaon_operator.routes.api import LearnedModel


class DimensionMismatch(ValueError):
    """The embedder answered a vector of another size than the model was trained on."""


@dataclass(frozen=True, slots=True)
class LearnedDecision:
    tier: int
    label: str
    probability: float

    @property
    def request_class(self) -> str:
        """The quality monitor's unit: `learned/<class label>`."""
        return f"learned/{self.label}"


def tier_of(label: str, services: list[str]) -> int:
    """A class's tier: its service's index, or the index it names (the spec checked one of them holds)."""
    return services.index(label) if label in services else int(label)


def scores(model: LearnedModel, vector: list[float]) -> list[float]:
    """weights[k] . x + bias[k] per class, x L2-normalized first when the model says so."""
    if len(vector) != model.dimension:
        raise DimensionMismatch(f"the embedder returned {len(vector)} values but the classifier was trained on "
                                f"{model.dimension}-dimensional {model.embedder} embeddings: point "
                                "classifier.learned.embedder at a service serving that model, or retrain")
    x = vector
    if model.normalize:
        norm = math.sqrt(sum(map(operator.mul, vector, vector))) or 1.0
        x = [v / norm for v in vector]
    return [sum(map(operator.mul, row, x)) + b for row, b in zip(model.weights, model.bias)]


def softmax(values: list[float]) -> list[float]:
    top = max(values)
    exps = [math.exp(v - top) for v in values]
    total = sum(exps)
    return [e / total for e in exps]


def decide(model: LearnedModel, vector: list[float], services: list[str]) -> LearnedDecision:
    """The class with the highest score, the tier it sends to and its probability."""
    probabilities = softmax(scores(model, vector))
    best = max(range(len(probabilities)), key=probabilities.__getitem__)
    label = model.classes[best]
    return LearnedDecision(tier_of(label, services), label, probabilities[best])
