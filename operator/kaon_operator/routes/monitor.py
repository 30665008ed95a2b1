"""The quality monitor's decisions. Pure.

A `verify.fraction` of the answers from lower tiers is re-asked of the top tier (the gateway does
that in the background); `agree()` compares the two answers: exact match (case, spacing and
punctuation aside) for short answers; for long ones their facts first (answer_facts.py: numbers, names,
negations, code that one answer changes in the other's words), then the cosine similarity of their embeddings when
the route has an embedder (verify.embedder, else the semantic cache's or the learned classifier's),
and word-set overlap as the fallback when it has none or it does not answer (docs/routing.md). `Agreement` keeps the
last WINDOW comparisons per (tier, class); a class whose agreement falls below `minAgreement` over at
least `minSamples` comparisons is escalated: its requests go one tier up.

An escalated class is not left there for good: a `verify.fraction` of its requests (answered one tier
up) is also asked of the tier it left, in the background, and compared with the top tier's answer.
`next_escalated()` decides with hysteresis: the class returns once its agreement over at least
`minSamples` comparisons measured since it was escalated reaches `recoverAgreement` (by default
minAgreement + RECOVERY_MARGIN, capped at 1), higher than the bar that escalated it, so that a class
whose agreement hovers at the bar does not flap between tiers. The decision reads the comparisons
since the last change of state only (`since`): those that escalated a class do not hold it there, and
those that brought it back do not count against it the next time. The metric and the status show the
plain rolling window (`results`).
"""
from __future__ import annotations

import math
import random
import re
from collections import deque
from dataclasses import dataclass, field

from kaon_operator.routes import answer_facts

WINDOW = 200
RECOVERY_MARGIN = 0.1
SHORT_ANSWER_WORDS = 12
LONG_ANSWER_SIMILARITY = 0.5
EMBEDDING_SIMILARITY = 0.77
"""verify.similarity's default: the cosine of two long answers' embeddings that counts as agreeing, when
their facts did not decide (answer_facts.py). Chosen on the dev half of bench/data/heldout/answer_pairs.jsonl
(bench/monitor_similarity.py: 0.772; 0.8 before the facts were compared)."""
_TOKEN = re.compile(r"\w+")


def should_verify(rng: random.Random, fraction: float, tier: int, tiers: int) -> bool:
    return tier < tiers - 1 and fraction > 0 and rng.random() < fraction


def recovery_bar(min_agreement: float, recover_agreement: float | None) -> float:
    """The agreement an escalated class needs to return (never below the bar that escalated it)."""
    bar = min(1.0, min_agreement + RECOVERY_MARGIN) if recover_agreement is None else recover_agreement
    return max(bar, min_agreement)


def next_escalated(escalated: bool, agreed: int, samples: int, min_agreement: float, min_samples: int,
                   recover_agreement: float) -> bool:
    """Whether a (tier, class) is escalated after its latest comparison: `agreed` of `samples` since its
    last change of state. Escalates below `min_agreement`, returns at or above `recover_agreement`, and
    holds its state in between and while fewer than `min_samples` comparisons are in."""
    if samples < min_samples:
        return escalated
    rate = agreed / samples
    if escalated:
        return rate < recover_agreement
    return rate < min_agreement


def _words(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def is_long(answer: str, reference: str) -> bool:
    """Whether the two answers are compared by similarity (embeddings, else word overlap), not exactly."""
    return max(len(_words(answer)), len(_words(reference))) > SHORT_ANSWER_WORDS


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def agree(answer: str, reference: str, similarity: float | None = None,
          threshold: float = EMBEDDING_SIMILARITY) -> bool:
    """Short answers: the same words. Long ones: their facts first (answer_facts.facts_differ: one
    text edited whose edits change a number, name, negation or code, or two texts whose numbers
    conflict, disagree), then, when the facts do not tell, with `similarity` (the cosine of the two
    answers' embeddings, when the route has an embedder that answered) at least `threshold`; without,
    the documented fallback: the Jaccard overlap of their word sets (order and repetition aside) at least
    LONG_ANSWER_SIMILARITY."""
    return compare(answer, reference, similarity, threshold)[0]


def compare(answer: str, reference: str, similarity: float | None = None,
            threshold: float = EMBEDDING_SIMILARITY) -> tuple[bool, str]:
    """(agreed, what decided): "words" (short answers), "edited" (one text edited: its facts decide),
    "numbers" (two texts whose numbers conflict), "embedding" or "overlap"."""
    a, b = _words(answer), _words(reference)
    if max(len(a), len(b)) <= SHORT_ANSWER_WORDS:
        return a == b, "words"
    edited = answer_facts.edited(answer, reference)
    if edited is not None:
        return edited, "edited"
    if answer_facts.numbers_conflict(answer, reference):
        return False, "numbers"
    if similarity is not None:
        return similarity >= threshold, "embedding"
    sa, sb = set(a), set(b)
    return len(sa & sb) / max(1, len(sa | sb)) >= LONG_ANSWER_SIMILARITY, "overlap"


@dataclass
class Agreement:
    """Per (tier, class): the last WINDOW comparisons (True: agreed with the top tier), and those since
    its last change of state (what next_escalated decides on)."""

    results: dict[tuple[str, str], deque[bool]] = field(default_factory=dict)
    since: dict[tuple[str, str], deque[bool]] = field(default_factory=dict)
    escalated: set[tuple[str, str]] = field(default_factory=set)

    def record(self, tier: str, request_class: str, agreed: bool) -> None:
        self.results.setdefault((tier, request_class), deque(maxlen=WINDOW)).append(agreed)
        self.since.setdefault((tier, request_class), deque(maxlen=WINDOW)).append(agreed)

    def rate(self, tier: str, request_class: str) -> tuple[float, int]:
        found = self.results.get((tier, request_class))
        if not found:
            return 1.0, 0
        return sum(found) / len(found), len(found)

    def changes(self, min_agreement: float, min_samples: int,
                recover_agreement: float) -> list[tuple[str, str, float, int, bool]]:
        """(tier, class, agreement, samples, escalated now) of each (tier, class) whose state changed
        (next_escalated), over the comparisons since its last change, which then start afresh (the
        caller posts one Event for each)."""
        out = []
        for key, found in self.since.items():
            was = key in self.escalated
            now = next_escalated(was, sum(found), len(found), min_agreement, min_samples, recover_agreement)
            if now == was:
                continue
            out.append((*key, sum(found) / len(found), len(found), now))
            (self.escalated.add if now else self.escalated.discard)(key)
            found.clear()
        return out


def escalate(tier: int, request_class: str, services: list[str], escalated: set[tuple[str, str]]) -> int:
    """The classifier's tier, moved up past every tier escalated for this class."""
    while tier < len(services) - 1 and (services[tier], request_class) in escalated:
        tier += 1
    return tier
