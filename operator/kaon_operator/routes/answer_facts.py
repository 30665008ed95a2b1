"""The facts two long answers state, as the quality monitor compares them before their embeddings. Pure.

The cosine of two answers' sentence embeddings says whether they are about the same thing, not whether
they say the same: an answer that keeps the other's words and changes one number, name or "not" embeds
at 0.97-1.0, closer than a faithful rewording (0.85) (bench/monitor_similarity.py). So, before the
embeddings:
- `edited()`: when the two answers are one text edited (difflib's word-sequence ratio at least
  EDITED_RATIO), the edits decide: they agree exactly when the facts the edits remove and the facts they
  add are the same set (a fact moved in the sentence is still there). Facts are numbers (digits, with
  their sign, unit symbols and thousands commas set aside), names (capitalized words not starting a
  sentence), negations ("not", "no", "never", "n't", ...) and code or math tokens (`code`, "=", "π",
  "²", a leading minus). Rewording edits without facts ("faster" / "more quickly") agree.
- `numbers_conflict()`: two answers written separately whose numbers conflict: each states a number the
  other does not, and they share none ("8 glasses a day" / "2.7 litres ... 3.7 litres"). An answer that
  adds numbers to the other's, or shares one, is left to the embeddings.
What it cannot see: a changed word that is no fact ("lower" / "higher"), or a wrong answer in
other words whose numbers do not clash: the embedding's cut-off (verify.similarity) decides those.
Chosen on the dev half of bench/data/heldout/answer_pairs.jsonl (bench/heldout.py's split); measured
on the test half (docs/routing.md).
"""
from __future__ import annotations

import difflib
import re

from kaon_operator.routes.prompt_words import NEGATIONS

EDITED_RATIO = 0.5
"""Word-sequence similarity (difflib ratio over the answers' tokens) from which two answers count as one
text edited."""

_TOKEN = re.compile(r"\S+")
_EDGES = re.compile(r"^[^\w`$£€%-]+|[^\w`%)]+$")
_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")
_CODE_OR_MATH = frozenset("`=<>^\u00b2\u00b3\u221a\u03c0\u00d7\u00f7\u00b1")  # powers, root, pi, x, /, +-
_SENTENCE_END = (".", "!", "?", ":")
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve".split())}


def _norm(token: str) -> str:
    return _EDGES.sub("", token.lower())


def _facts(tokens: list[str], before: str | None) -> set[str]:
    """The facts among `tokens` (`before`: the token just before them, to tell a sentence's start)."""
    out = set()
    previous = before
    for token in tokens:
        word = _norm(token)
        if any(ch.isdigit() for ch in token) or any(ch in _CODE_OR_MATH for ch in token) or token[:1] in "-\u2212":
            out.add(word)
        elif word in NEGATIONS or word.endswith("n't"):
            out.add("<negation>")
        else:
            core = token.strip("\"'()[],.;:!?\u201c\u201d\u2018\u2019")
            if core[:1].isupper() and core != "I" and previous is not None and not previous.endswith(_SENTENCE_END):
                out.add(word)
        previous = token
    return out


def edited(answer: str, reference: str) -> bool | None:
    """None when the two answers are not one text edited; else whether the edits keep the same facts."""
    a, b = _TOKEN.findall(answer), _TOKEN.findall(reference)
    matcher = difflib.SequenceMatcher(None, [_norm(t) for t in a], [_norm(t) for t in b], autojunk=False)
    if matcher.ratio() < EDITED_RATIO:
        return None
    removed: set[str] = set()
    added: set[str] = set()
    for op, i1, i2, j1, j2 in matcher.get_opcodes():
        if op != "equal":
            removed |= _facts(a[i1:i2], a[i1 - 1] if i1 else None)
            added |= _facts(b[j1:j2], b[j1 - 1] if j1 else None)
    return removed == added


def numbers(text: str) -> set[str]:
    """The text's numbers (thousands commas dropped; "one" .. "twelve" as digits)."""
    found = {n.replace(",", "") for n in _NUMBER.findall(text)}
    return found | {_NUMBER_WORDS[w] for w in map(_norm, _TOKEN.findall(text)) if w in _NUMBER_WORDS}


def numbers_conflict(answer: str, reference: str) -> bool:
    a, b = numbers(answer), numbers(reference)
    return bool(a - b) and bool(b - a) and not (a & b)
