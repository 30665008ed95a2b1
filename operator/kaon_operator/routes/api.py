"""The InferenceRoute API (kaon.dev/v1alpha1): pydantic models of its spec and status.

The CRD (crds/inferenceroute.yaml) is generated from them by `python -m kaon_operator.routes.crd`.
"""
from __future__ import annotations

from pydantic import Field, model_validator

from kaon_operator.api import GROUP, VERSION, AuthSpec, _cel, _Model

KIND = "InferenceRoute"
PLURAL = "inferenceroutes"
API_VERSION = f"{GROUP}/{VERSION}"
MAX_TIERS = 8
_SERVICE_NAME = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"


class TierSpec(_Model):
    service: str = Field(pattern=_SERVICE_NAME, max_length=63)
    """An InferenceService of the route's namespace (its metadata.name)."""
    cost_per_million_tokens: float = Field(ge=0)
    """What a million tokens (prompt and completion) cost on this tier, in any currency: the route's
    cost figures (status, metrics) are in it."""


class RulesSpec(_Model):
    thresholds: list[float] = Field(default_factory=lambda: [1.5, 3.5], min_length=1, max_length=MAX_TIERS - 1)
    """Complexity scores at which a request moves up one tier (classifier.py's rule set scores a request
    from its length, reasoning keywords, entity count and domain); with 2 tiers only the first is used."""


MAX_DIMENSION = 4096
MAX_CLASSES = MAX_TIERS


class LearnedModel(_Model):
    """What `kaon route train` writes (a JSON file): a multinomial logistic regression over a sentence
    encoder's embeddings of the prompt. Class k's score is weights[k] . x + bias[k], x the embedding
    (L2-normalized first when `normalize`); the highest score wins."""
    format: str = Field(default="kaon.route-classifier/v1", pattern=r"^kaon\.route-classifier/v1$")
    """The file's format and version."""
    embedder: str = Field(min_length=1, max_length=253)
    """The encoder the model was trained on (e.g. all-minilm-l6-v2); the route's embedder must serve it."""
    dimension: int = Field(ge=1, le=MAX_DIMENSION)
    """The embeddings' size (384 for all-MiniLM-L6-v2); a vector of another size falls back to the rules."""
    normalize: bool = True
    """L2-normalize the embedding before scoring (as in training)."""
    classes: list[str] = Field(min_length=2, max_length=MAX_CLASSES)
    """Per class, the tier it sends to: a tier's index ("0" the cheapest) or its service name."""
    weights: list[list[float]] = Field(min_length=2, max_length=MAX_CLASSES)
    """One row of `dimension` weights per class, in `classes`' order."""
    bias: list[float] = Field(min_length=2, max_length=MAX_CLASSES)
    """One per class."""
    examples: int = Field(default=0, ge=0)
    """How many labelled examples it was fitted on (information only)."""

    @model_validator(mode="after")
    def _shapes(self) -> LearnedModel:
        if not len(self.classes) == len(self.weights) == len(self.bias):
            raise ValueError(f"the model has {len(self.classes)} classes, {len(self.weights)} weight rows and "
                             f"{len(self.bias)} biases: they must be equal")
        for k, row in enumerate(self.weights):
            if len(row) != self.dimension:
                raise ValueError(f"weights row {k} has {len(row)} values but the model's dimension is "
                                 f"{self.dimension}: the file is damaged or was edited")
        return self


class LearnedSpec(_Model):
    embedder: str = Field(pattern=_SERVICE_NAME, max_length=63)
    """An InferenceService of the namespace serving the model's encoder with `--task embed`
    (e.g. `kaon serve --model builtin://all-minilm-l6-v2 --task embed`)."""
    model: LearnedModel
    """The JSON `kaon route train` wrote, inline."""


class ClassifierSpec(_Model):
    mode: str = Field(default="rules", pattern="^(rules|learned)$")
    """`rules`: the built-in rule set. `learned`: the model in `learned` on the prompt's embedding (the
    rule set decides when the embedder cannot answer)."""
    rules: RulesSpec = Field(default_factory=RulesSpec)
    learned: LearnedSpec | None = None

    @model_validator(mode="after")
    def _learned_present(self) -> ClassifierSpec:
        if self.mode == "learned" and self.learned is None:
            raise ValueError("classifier.mode learned needs classifier.learned (embedder and model)")
        return self


class VerifySpec(_Model):
    fraction: float = Field(default=0.0, ge=0, le=1)
    """The share of lower tiers' answers re-asked of the top tier in the background and compared."""
    min_agreement: float = Field(default=0.8, ge=0, le=1)
    """A class whose agreement with the top tier falls below this (over at least `minSamples`
    comparisons) is escalated to the next tier, with an Event."""
    min_samples: int = Field(default=20, ge=1, le=100000)
    """Comparisons of a (tier, class) needed before its agreement may escalate it (or bring it back)."""
    embedder: str | None = Field(default=None, min_length=1)
    """The InferenceService (serving `--task embed`, e.g. builtin://all-minilm-l6-v2) whose embeddings
    compare long answers (over 12 words); default: cache.semantic's embedder, else
    classifier.learned's. Without any (or when it does not answer), long answers are compared by the
    overlap of their word sets."""
    similarity: float = Field(default=0.77, ge=0, le=1)
    """The cosine of two long answers' embeddings at which they agree, when their facts do not decide: two
    answers that are one text edited agree exactly when the edits keep the same numbers, names, negations
    and code; two answers whose numbers conflict disagree (routes/answer_facts.py)."""
    recover_agreement: float | None = Field(default=None, ge=0, le=1)
    """An escalated class returns to its tier once its agreement, over at least `minSamples` comparisons
    since it was escalated (a `fraction` of its requests is also asked of the tier it left), reaches
    this. Default: minAgreement + 0.1 (at most 1); never below minAgreement (hysteresis: no flapping)."""


class ExactCacheSpec(_Model):
    enabled: bool = True
    deterministic_only: bool = True
    """Cache only requests whose answer is deterministic: temperature 0 or a fixed seed."""


class SemanticCacheSpec(_Model):
    enabled: bool = False
    """Opt-in: a request whose prompt embeds within `threshold` (cosine) of a cached one's gets that answer."""
    embedder: str | None = Field(default=None, pattern=_SERVICE_NAME, max_length=63)
    """An InferenceService of the namespace serving `--task embed` (/v1/embeddings)."""
    threshold: float = Field(default=0.95, gt=0, le=1)
    """The cosine at which a cached prompt in other words matches (the near-miss guard's `reworded` verdict,
    routes/anchors.py)."""
    same_words_threshold: float = Field(default=0.5, ge=0, le=1)
    """The cosine at which a cached prompt with the same content words matches (the guard's `same-words`
    verdict: only case, punctuation, contractions, politeness, framing, plurals, common synonyms, a typo or
    a moved clause differ); the lower of this and `threshold`. Set it to `threshold` for one cut-off."""


class CacheSpec(_Model):
    exact: ExactCacheSpec = Field(default_factory=ExactCacheSpec)
    semantic: SemanticCacheSpec = Field(default_factory=SemanticCacheSpec)
    ttl_seconds: int = Field(default=3600, ge=1, le=30 * 86400)
    max_entries: int = Field(default=10000, ge=1, le=10_000_000)
    valkey: str | None = Field(default=None, pattern=r"^(redis|valkey)://[^ ]+$", max_length=512)
    """`redis://host:port/db` of a Valkey or Redis server shared by every router replica; without it the
    cache lives in each router's memory."""


class InferenceRouteSpec(_Model):
    tiers: list[TierSpec] = Field(min_length=1, max_length=MAX_TIERS, json_schema_extra=_cel(
        "self.all(t, self.exists_one(u, u.service == t.service))", "tiers must name distinct services"))
    """Cheapest first; each an InferenceService in this namespace."""
    classifier: ClassifierSpec = Field(default_factory=ClassifierSpec)
    verify: VerifySpec = Field(default_factory=VerifySpec)
    cache: CacheSpec = Field(default_factory=CacheSpec)
    auth: AuthSpec | None = None
    """API keys of the route itself (a Secret of this namespace); a keyed tier also checks its own."""

    def monitor_embedder(self) -> str | None:
        """The InferenceService whose embeddings compare the monitor's long answers (None: word overlap)."""
        learned = self.classifier.learned if self.classifier.mode == "learned" else None
        semantic = self.cache.semantic.embedder if self.cache.semantic.enabled else None
        return self.verify.embedder or semantic or (learned.embedder if learned else None)

    @model_validator(mode="after")
    def _distinct(self) -> InferenceRouteSpec:
        names = [t.service for t in self.tiers]
        if len(set(names)) != len(names):
            raise ValueError("tiers must name distinct services")
        learned = self.classifier.learned
        if learned is not None:
            for label in learned.model.classes:
                if not (label in names or (label.isdigit() and int(label) < len(names))):
                    raise ValueError(f"classifier.learned.model's class {label!r} names no tier: use a tier's "
                                     f"index (0..{len(names) - 1}) or service ({', '.join(names)})")
        return self


class TierStatus(_Model):
    service: str
    share: float = 0.0
    """This tier's share of the requests the models answered (cache hits left out)."""
    requests: int = 0


class AgreementStatus(_Model):
    tier: str
    request_class: str = Field(alias="class")
    agreement: float
    samples: int
    escalated: bool = False


class ReplicaTierCount(_Model):
    service: str
    requests: int = 0


class ReplicaAgreementCount(_Model):
    tier: str
    request_class: str = Field(alias="class")
    agreed: int = 0
    samples: int = 0
    escalated: bool = False


class ReplicaStatus(_Model):
    """One router replica's raw counts (routes/replicas.py); the status' totals are their sum."""

    name: str
    """The router pod."""
    updated: str
    """When it last wrote; an entry older than 3 minutes is not counted (its replica is gone), one older than
    10 minutes is removed by a live router replica."""
    tiers: list[ReplicaTierCount] = Field(default_factory=list)
    hits: int = 0
    misses: int = 0
    cost: float = 0.0
    top_cost: float = 0.0
    agreement: list[ReplicaAgreementCount] = Field(default_factory=list)


class InferenceRouteStatus(_Model):
    tiers: list[TierStatus] = Field(default_factory=list)
    shares: str = ""
    """The tiers' shares in one line (`small 80% / large 20%`): the `kubectl get` column."""
    requests: int = 0
    cache_hit_rate: float = 0.0
    cost_vs_top_tier: float = 1.0
    """What the answered requests cost against sending every one to the top tier (1.0: the same)."""
    agreement: list[AgreementStatus] = Field(default_factory=list)
    replicas: list[ReplicaStatus] = Field(default_factory=list, json_schema_extra={
        "x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    """Per router replica, the counts the totals add up (each replica writes its own entry)."""
    conditions: list[dict] = Field(default_factory=list)
    observed_generation: int | None = None
