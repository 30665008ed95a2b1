"""The semantic cache's guard as it was before issue 52's routes4 round (commit 67d3d4a), frozen here so
that bench/semantic_near_misses.py measures the guard of today against it in the same run: one
threshold for every match; names compared with their case and in order (also in the semantic scope).
Not used by the router.

The text below is that module's, unchanged:

A sentence encoder such as all-MiniLM-L6-v2 puts "What is the capital of France?" and "... of
Germany?" at cosine 0.9+, and "from English to French" next to "from French to English" at 0.99: a
similarity threshold alone cannot keep such near misses out (bench/routing_tiers.py measures it:
docs/routing.md). Their difference is in the request's anchors: numbers, quoted text and names
(capitalized words past a sentence's first), and in their order. A semantic match must have the same
anchors in the same order (`anchors()` is part of the semantic scope, cache_keys.semantic_scope), so
the embedding decides only among prompts about the same things. A negation on one side only ("have
rings" / "have no rings") refuses a match too.

What it does not catch: a change of a lowercase word that flips the answer (high/low, for/against,
install/uninstall, a unit's direction such as miles to kilometers). What it costs: a paraphrase that
names the same thing in another spelling or case ("france") misses (a miss costs one model call; a
false hit returns another question's answer).
"""
from __future__ import annotations

import re

# A quote opens after no word character and closes before none: the apostrophes of "What's gold's"
# quote nothing.
_QUOTED = re.compile(r"(?<!\w)(?:\"([^\"]{1,200})\"|'([^']{1,200})'|“([^”]{1,200})”)(?!\w)")
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d+(?:[.,]\d+)*(?:\.\d+)?%?")
_WORD = re.compile(r"[A-Za-z][\w'#+-]*|[.!?]")
_NOT_NAMES = frozenset({"I", "I'm", "I've", "I'd", "I'll", "OK"})


def anchors(text: str) -> tuple[str, ...]:
    """The text's numbers, quoted spans and names (capitalized words not starting a sentence), in
    order, lowercased."""
    found: list[tuple[int, str]] = []
    for m in _QUOTED.finditer(text):
        found.append((m.start(), next(g for g in m.groups() if g is not None).strip().lower()))
    rest = _QUOTED.sub(lambda m: " " * len(m.group(0)), text)
    found += [(m.start(), m.group(0).replace(",", "")) for m in _NUMBER.finditer(rest)]
    sentence_start = True
    for m in _WORD.finditer(rest):
        word = m.group(0)
        if word in ".!?":
            sentence_start = True
            continue
        if not sentence_start and word[0].isupper() and word not in _NOT_NAMES:
            found.append((m.start(), word.lower()))
        sentence_start = False
    return tuple(word for _, word in sorted(found))


_TOKEN = re.compile(r"[\w'#+-]+")


def _tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


# Negations flip an answer while moving an embedding very little ("Which planets have rings?" / "... have no
# rings?": cosine 0.96 with all-MiniLM-L6-v2), a known weakness of sentence encoders.
_NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "without", "cannot"})


def _negated(tokens: list[str]) -> bool:
    """Whether the words say no an odd number of times ("not", "no", "never", "cannot", "don't", ...)."""
    count = sum(t in _NEGATIONS or t.endswith("n't") for t in tokens)
    return count % 2 == 1


def may_match(prompt: str, cached: str) -> bool:
    """Whether a semantic match between two prompts the embedder finds close may stand. Refused:
    different anchors (or in another order); the same words in another order ("from English to
    French" / "from French to English", "miles to kilometers" / "kilometers to miles"); and one word
    put for another ("arguments for" / "against", "high" / "low in protein"): the shape of a near
    miss, rarely of a paraphrase (which rewords more than one word); and one negated where the other is
    not ("reasons to learn" / "reasons not to learn"). An unknown cached prompt ("") is refused."""
    if not cached or anchors(prompt) != anchors(cached):
        return False
    a, b = _tokens(prompt), _tokens(cached)
    if a == b:
        return True
    if sorted(a) == sorted(b) or _negated(a) != _negated(b):
        return False
    return not (len(a) == len(b) and sum(x != y for x, y in zip(a, b, strict=True)) == 1)
