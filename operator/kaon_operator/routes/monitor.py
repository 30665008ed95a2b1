"""The quality monitor's decisions. Pure.

A `verify.fraction` of the answers from lower tiers is re-asked of the top tier (the gateway does
that in the background); `agree()` compares the two answers: exact match (case, spacing and
punctuation aside) for short answers, word overlap for long ones (the stand-in for embedding
similarity until the learned classifier's encoder runs here; docs/routing.md). `Agreement` keeps the
last WINDOW comparisons per (tier, class); a class whose agreement falls below `minAgreement` over at
least `minSamples` comparisons is escalated: its requests go one tier up from then on.
"""
from __future__ import annotations

import random
import re
from collections import deque
from dataclasses import dataclass, field

WINDOW = 200
SHORT_ANSWER_WORDS = 12
LONG_ANSWER_SIMILARITY = 0.5
_TOKEN = re.compile(r"\w+")


def should_verify(rng: random.Random, fraction: float, tier: int, tiers: int) -> bool:
    return tier < tiers - 1 and fraction > 0 and rng.random() < fraction


def _words(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def agree(answer: str, reference: str) -> bool:
    a, b = _words(answer), _words(reference)
    if max(len(a), len(b)) <= SHORT_ANSWER_WORDS:
        return a == b
    # Long answers: the Jaccard overlap of their word sets (order and repetition aside).
    sa, sb = set(a), set(b)
    return len(sa & sb) / max(1, len(sa | sb)) >= LONG_ANSWER_SIMILARITY


@dataclass
class Agreement:
    """Per (tier, class): the last WINDOW comparisons (True: agreed with the top tier)."""

    results: dict[tuple[str, str], deque[bool]] = field(default_factory=dict)
    escalated: set[tuple[str, str]] = field(default_factory=set)

    def record(self, tier: str, request_class: str, agreed: bool) -> None:
        self.results.setdefault((tier, request_class), deque(maxlen=WINDOW)).append(agreed)

    def rate(self, tier: str, request_class: str) -> tuple[float, int]:
        found = self.results.get((tier, request_class))
        if not found:
            return 1.0, 0
        return sum(found) / len(found), len(found)

    def newly_escalated(self, min_agreement: float, min_samples: int) -> list[tuple[str, str, float, int]]:
        """(tier, class, agreement, samples) of each (tier, class) that now falls below the bar and was not
        escalated before; they are escalated from now on (the caller posts one Event for each)."""
        out = []
        for (tier, cls), found in self.results.items():
            if (tier, cls) in self.escalated or len(found) < min_samples:
                continue
            rate = sum(found) / len(found)
            if rate < min_agreement:
                self.escalated.add((tier, cls))
                out.append((tier, cls, rate, len(found)))
        return out


def escalate(tier: int, request_class: str, services: list[str], escalated: set[tuple[str, str]]) -> int:
    """The classifier's tier, moved up past every tier escalated for this class."""
    while tier < len(services) - 1 and (services[tier], request_class) in escalated:
        tier += 1
    return tier
