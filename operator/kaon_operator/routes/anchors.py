"""The semantic cache's guard against near misses. Pure.

A sentence encoder such as all-MiniLM-L6-v2 puts "What is the capital of France?" and "... of
Germany?" at cosine 0.9+, and "from English to French" next to "from French to English" at 0.99: a
similarity threshold alone cannot keep such near misses out (bench/semantic_near_misses.py measures it:
docs/routing.md). Their difference is in words a question cannot do without: a name, a number, a word
put for another, a constraint added, a negation, an order. `verdict()` compares the two prompts'
words (prompt_words.py) and says what it could verify:
- SAME_WORDS: the same content words, once case, punctuation, contractions, politeness, framing,
  plurals, common synonyms, a typo and a moved clause are set aside. Every near miss changes a content
  word, so the embedding only has to agree loosely (cache.semantic.sameWordsThreshold, default 0.5:
  typos move an embedding a lot, "captial of Germnay" is at 0.3).
- REWORDED: other words, but nothing of a near miss's shape (`reworded`): the embedding must be close
  (cache.semantic.threshold, default 0.95).
- REFUSED: another number (numbers are part of the semantic scope, cache_keys.semantic_scope), name,
  quoted text, negation; names or numbers swapped; the same words in another order; one content word
  put for another; one prompt's content words plus more.

What it does not catch: a change of lowercase words in more than one place that flips the answer
("cheapest" / "most expensive"), which the REWORDED threshold has to refuse. What it costs: a paraphrase
that changes exactly one word for a word not in prompt_words.SYNONYMS, or adds a content word ("the
capital city of France"), misses (a miss costs one model call; a false hit returns another question's
answer). bench/guard_routes3.py keeps the previous guard (one threshold; names compared with their case,
in order) for comparison.
"""
from __future__ import annotations

import re
from collections import Counter

from kaon_operator.routes import prompt_words

# A quote opens after no word character and closes before none: the apostrophes of "What's gold's"
# quote nothing.
_QUOTED = re.compile(r"(?<!\w)(?:\"([^\"]{1,200})\"|'([^']{1,200})'|“([^”]{1,200})”)(?!\w)")
_WORD = re.compile(r"[A-Za-z][\w'#+-]*|[.!?]")
_NOT_NAMES = frozenset({"I", "I'm", "I've", "I'd", "I'll", "OK"})


SAME_WORDS, REWORDED, REFUSED = "same-words", "reworded", "refused"


def verdict(prompt: str, cached: str) -> str:
    """What the guard verified of two prompts the embedder finds close:
    - SAME_WORDS: the same content words once case, punctuation, contractions, politeness, framing,
      plurals, common synonyms, a typo per word and the place of whole clauses are set aside
      (prompt_words.same_words), no negation on one side only: a near miss must change a content word, so
      such a pair needs only a loose embedding check (`sameWordsThreshold`);
    - REWORDED: other words (`reworded`), whose embeddings must be close (`threshold`);
    - REFUSED: anything else, and always when the numbers differ (they are part of the semantic scope)."""
    if not cached or prompt_words.numbers(prompt) != prompt_words.numbers(cached):
        return REFUSED
    if prompt_words.same_words(prompt, cached):
        return SAME_WORDS
    return REWORDED if reworded(prompt, cached) else REFUSED


def reworded(prompt: str, cached: str) -> bool:
    """Whether two prompts in other words may still ask the same: the same quoted spans; each one's names
    (capitalized words past a sentence's first) among the other's words, whatever their case ("Tokyo" /
    "tokyo"), and in the same order within a clause (prompt_words.in_order: no swap); not the same words
    in another order; the same negation; not one content word put for another; and not one's content
    words plus more (prompt_words.added_only: a constraint added)."""
    if _quoted(prompt) != _quoted(cached):
        return False
    ca, cb = prompt_words.content(prompt), prompt_words.content(cached)
    wa, wb = [w for w, _ in ca], [w for w, _ in cb]
    names_a, names_b = _names(prompt), _names(cached)
    if not (names_a <= set(wb) and names_b <= set(wa)):
        return False
    if Counter(wa) == Counter(wb) or prompt_words.negated(wa) != prompt_words.negated(wb):
        return False  # the same words in another order ("miles to kilometers" / "kilometers to miles")
    anchored = names_a | names_b | {w for w in wa if w[0].isdigit()}
    if not prompt_words.in_order([p for p in ca if p[0] in anchored], [p for p in cb if p[0] in anchored]):
        return False  # names or numbers swapped ("from Canada to the US" / "from the US to Canada")
    only_a, only_b = Counter(wa) - Counter(wb), Counter(wb) - Counter(wa)
    if sum(only_a.values()) == 1 and sum(only_b.values()) == 1:
        return False  # one word put for another ("arguments for" / "against", "opposite" / "synonym")
    return not prompt_words.added_only(prompt, cached)


def _quoted(text: str) -> list[str]:
    return sorted(next(g for g in m.groups() if g is not None).strip().lower() for m in _QUOTED.finditer(text))


def _names(text: str) -> set[str]:
    """The canonical words of the text's names (capitalized words not starting a sentence)."""
    out: set[str] = set()
    sentence_start = True
    for m in _WORD.finditer(_QUOTED.sub(" ", text)):
        word = m.group(0)
        if word in ".!?":
            sentence_start = True
            continue
        if not sentence_start and word[0].isupper() and word not in _NOT_NAMES:
            for token in prompt_words.content(word):
                out.add(token[0])
        sentence_start = False
    return out


def may_match(prompt: str, cached: str) -> bool:
    """Whether a semantic match may stand at all (at some threshold): verdict() is not REFUSED."""
    return verdict(prompt, cached) != REFUSED


def cut_off(found: str, threshold: float, same_words_threshold: float) -> float | None:
    """The cosine a match of this verdict needs (None: refused at any cosine)."""
    if found == SAME_WORDS:
        return min(threshold, same_words_threshold)
    return threshold if found == REWORDED else None


def accepts(prompt: str, cached: str, similarity: float, threshold: float, same_words_threshold: float) -> bool:
    """The semantic cache's decision for the nearest cached prompt: its cosine at least the cut-off of what
    the guard verified (SAME_WORDS: min(threshold, same_words_threshold); REWORDED: threshold)."""
    needed = cut_off(verdict(prompt, cached), threshold, same_words_threshold)
    return needed is not None and similarity >= needed
