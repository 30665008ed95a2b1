"""The built-in rule set: a request's complexity from the request alone, in microseconds.

Features (the issue's seed): the prompt's length in words, reasoning keywords ("analyze", "compare",
"step by step", ...), the count of named entities and numbers, the number of questions, and the
domain (code, math, law, medicine: each weighs a little). The score is their weighted sum; the
route's thresholds turn it into a tier. The class a request falls in (its level and domain) is what
the quality monitor keeps agreement for. Pure: no I/O, no clock.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kaon_wire import content_text

# Phrases that ask for reasoning rather than recall; each found adds REASONING_WEIGHT.
REASONING = ("analyze", "analyse", "analysis", "compare", "comparison", "contrast", "step by step", "step-by-step",
             "explain why", "explain how", "evaluate", "assess", "prove", "derive", "justify", "trade-off",
             "tradeoff", "pros and cons", "critique", "design a", "plan a", "strategy", "implications",
             "reason about", "walk me through", "in detail", "multi-step", "optimize", "optimise", "debug")
DOMAINS = {
    "code": ("```", "def ", "class ", "function", "algorithm", "python", "javascript", "sql", "compile", "regex",
             "stack trace", "api"),
    "math": ("equation", "integral", "derivative", "theorem", "probability", "matrix", "solve for", "proof"),
    "law": ("contract", "liability", "statute", "jurisdiction", "clause", "legal"),
    "medicine": ("diagnosis", "symptom", "dosage", "treatment", "clinical"),
}
REASONING_WEIGHT = 1.5
DOMAIN_WEIGHT = 0.75
_WORD = re.compile(r"[\w'-]+")
_ENTITY = re.compile(r"(?<![.!?]\s)(?<!^)\b[A-Z][a-z]+(?:\s[A-Z][a-z]+)*|\b\d[\d,.]*\b")
_PHRASES = re.compile(r"\b(?:" + "|".join(re.escape(p) for p in REASONING) + r")")


def _markers(words: tuple[str, ...]) -> re.Pattern[str]:
    # Whole words ("api" must not match "capital"); a marker of symbols ("```") matches anywhere.
    return re.compile("|".join(re.escape(w) if not w[0].isalnum() else r"\b" + re.escape(w.strip()) + r"\b"
                               for w in words))


_DOMAIN_MARKERS = {name: _markers(words) for name, words in DOMAINS.items()}


@dataclass(frozen=True, slots=True)
class Features:
    words: int
    reasoning: int
    entities: int
    questions: int
    domain: str  # "general" when none


@dataclass(frozen=True, slots=True)
class Decision:
    tier: int
    request_class: str
    """`<level>/<domain>`: `simple/general`, `complex/code`, ... (the monitor's unit)."""
    score: float


def prompt_text(path: str, payload: dict) -> str:
    """The text a request asks about: chat messages' text parts (all roles), a completion's prompt,
    an embeddings request's input, a /v1/responses input."""
    if path.endswith("/chat/completions"):
        return "\n".join(content_text(m.get("content")) for m in payload.get("messages") or () if isinstance(m, dict))
    value = payload.get("prompt") if "prompt" in payload else payload.get("input")
    return content_text(value)


def features(text: str) -> Features:
    lower = text.lower()
    domain, best = "general", 0
    for name, markers in _DOMAIN_MARKERS.items():
        hits = len(markers.findall(lower))
        if hits > best:
            domain, best = name, hits
    return Features(words=len(_WORD.findall(text)), reasoning=len(_PHRASES.findall(lower)),
                    entities=len(_ENTITY.findall(text)), questions=text.count("?"), domain=domain)


def score(f: Features) -> float:
    """Weighted sum of the features: a short factual question scores under 1, a multi-step
    analysis over 3."""
    length = 0.0 if f.words <= 40 else 1.0 if f.words <= 150 else 2.0
    entities = 0.0 if f.entities <= 3 else 0.5 if f.entities <= 8 else 1.0
    questions = 0.5 if f.questions > 1 else 0.0
    domain = 0.0 if f.domain == "general" else DOMAIN_WEIGHT
    return length + REASONING_WEIGHT * min(f.reasoning, 3) + entities + questions + domain


def tier_for(value: float, thresholds: list[float] | tuple[float, ...], tiers: int) -> int:
    """With N tiers the first N-1 thresholds split the score: below the first, tier 0; and so on.
    Two tiers use the first threshold only; with fewer thresholds than needed, the top tier takes the rest."""
    if tiers <= 1:
        return 0
    cut = list(thresholds)[: tiers - 1]
    tier = sum(value >= t for t in cut)
    return min(tier, tiers - 1)


def classify(text: str, thresholds: list[float] | tuple[float, ...], tiers: int) -> Decision:
    f = features(text)
    value = score(f)
    tier = tier_for(value, thresholds, tiers)
    level = "simple" if value < (thresholds[0] if thresholds else 1.5) else "complex"
    return Decision(tier, f"{level}/{f.domain}", value)
