"""A prompt's words as the semantic cache's guard compares them. Pure.

Two prompts that ask the same thing often differ only in how they are written: case and punctuation
("IS COFFEE BAD FOR YOU?!"), contractions ("can't" / "cannot", "what's" / "whats"), politeness and
question framing ("Hi! Could you please tell me ...", "Explain ...", "I'd like to know ..."), plural
forms, a clause moved to the other end ("In 2018, who won ..." / "Who won ... in 2018?"), a common
synonym or abbreviation ("begin" / "start", "NYC"), a typo ("captial"). `content()` reduces a prompt to
what remains: its content words (lowercased, contractions expanded, a light plural stem, synonyms and
number words to one spelling) with the clause each sits in, dropping the words listed in FILLER and
the framing verbs of FRAMES at a clause's start. `same_words()` says two prompts have the same
content words, as many times each (a typo of one word on one side allowed: `typo()`), no negation on
one side only, and within each clause that both keep, the same order (a moved clause is fine; "kilograms
to pounds" / "pounds to kilograms" is not).

The lists are short and general (English only); they were chosen on bench/data/heldout's dev half and
the guard's own development sets, never on the test half (bench/heldout.py). A word missing from them
costs a miss (the prompt is then compared as a rewording, at the route's threshold), never a false hit
on its own: near misses differ in content words, which are never dropped (negations, prepositions,
numbers, operators, question words other than "what" / "which" all stay).
"""
from __future__ import annotations

import functools
import re
from collections import Counter
from collections.abc import Sequence

# Words that carry no content of the question: articles, the asker's pronouns, present-tense and polite
# auxiliaries ("could you", "can I"; tense and modality stay: "was", "will", "did", "should", "must"),
# greetings, thanks and framing ("tell me", "I'd like to know"), and "what"/"which" (the default
# question: "capital of peru?" asks "what is ...").
FILLER = frozenset("""
a an the i me my you your u ur we us our it its this that these those
is are am be been being do does doing would could can
please pls plz kindly hi hello hey yo dear thanks thank thx ty cheers appreciated sorry bother
so just some quick question wondering wonder curious idea any anyone someone somebody
tell telling know let like love want wanted need needed looking mind
what which there here team folks guys everyone sir madam ok okay
""".split())
# Phrases of politeness whose words are not all fillers on their own ("in advance", "how to").
_PHRASES = (
    (re.compile(r"\b(?:i was|i am|just) wondering\b"), " "), (re.compile(r"\bin advance\b"), " "),
    (re.compile(r"\bmuch appreciated\b"), " "), (re.compile(r"\b(?:thanks|thank you) (?:so |very )?much\b"), " "),
    (re.compile(r"\bhow to\b"), "how"),
)
# Imperative framing at a clause's start ("Explain how vaccines work." / "How do vaccines work?").
FRAMES = frozenset("explain describe list name give show recommend suggest define provide share find".split())
NEGATIONS = frozenset({"not", "no", "never", "none", "nothing", "nobody", "neither", "nor", "without"})
# One spelling for words that mean the same in a question (common, unambiguous ones only).
SYNONYMS = {
    "quickest": "fastest", "quick": "fast", "quickly": "fast", "begin": "start", "beginning": "start",
    "simple": "easy", "erase": "delete", "remove": "delete", "gift": "present", "rug": "carpet",
    "terminate": "cancel", "uncooked": "raw", "purchase": "buy", "large": "big", "huge": "big",
    "little": "small", "largest": "biggest", "smallest": "tiniest", "tiny": "small",
    "kid": "child", "children": "child", "film": "movie",
    "picture": "photo",
    "physician": "doctor", "automobile": "car", "repair": "fix", "price": "cost",
    "diff": "difference", "info": "information", "ppl": "people", "tsp": "teaspoon", "tbsp": "tablespoon",
    "versus": "vs", "usa": "united states", "nyc": "new york city", "u.s": "united states", "wifi": "wi fi",
    "e-mail": "email",
    "javascript": "js", "nodejs": "node js", "node.js": "node js",
}
_NUMBER_WORDS = {w: str(i) for i, w in enumerate(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty".split())}
# ("second" is left out: more often the unit of time)
_ORDINALS = {w: f"{i}th" for i, w in enumerate(
    "zeroth first - third fourth fifth sixth seventh eighth ninth tenth eleventh twelfth thirteenth "
    "fourteenth fifteenth sixteenth seventeenth eighteenth nineteenth twentieth".split()) if w != "-"}
_ORDINAL_DIGITS = re.compile(r"^(\d+)(?:st|nd|rd|th)$")
_CLAUSE_END = frozenset(",;:.!?")

_CONTRACTIONS_PLAIN = (  # written without an apostrophe
    (re.compile(r"\b(?:cant|cannot)\b"), "can not"),
    (re.compile(r"\bwont\b"), "will not"),
    (re.compile(r"\b(do|does|did|is|are|was|were|has|have|had|should|would|could|must)nt\b"), r"\1 not"),
    (re.compile(r"\b(what|that|it|there|here|who|where|how|when|why|which|he|she|let)s\b"), r"\1 is"),
)
_CONTRACTIONS = (  # with one (only looked for when the text has one)
    (re.compile(r"\bcan't\b"), "can not"),
    (re.compile(r"\bwon't\b"), "will not"),
    (re.compile(r"n't\b"), " not"),
    (re.compile(r"'re\b"), " are"), (re.compile(r"'m\b"), " am"), (re.compile(r"'ll\b"), " will"),
    (re.compile(r"'ve\b"), " have"), (re.compile(r"'d\b"), " would"),
    # "what's", "where's": the verb; any other "'s" is a possessive (dropped: "gold's" -> "gold").
    (re.compile(r"\b(what|that|it|there|here|who|where|how|when|why|which|he|she|let)'s\b"), r"\1 is"),
    (re.compile(r"'s\b"), ""),
)
# Numbers (1,000 -> 1000; 3.5 stays), words (dots inside kept for "node.js", "u.s."), operators and
# symbols that change a question ("2+2" / "2*2"), clause punctuation.
_TOKEN = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?(?:st|nd|rd|th)?|[^\W\d_][^\W_]*(?:\.[^\W_]+)*"
                    "|[-+*/=^%$\u20ac\u00a3<>\u00d7\u00f7#]|[,;:.!?]")
_US = re.compile(r"\bU\.?S\.?A?\b\.?")  # the country, not the pronoun "us" (a filler)
_MINUS = re.compile(r"(?<=\d)\s*-\s*(?=\d)")


def _stem(word: str) -> str:
    """A light plural stem (viruses -> virus, cities -> city, cats -> cat); nothing else."""
    if len(word) <= 3 or not word.isalpha():
        return word
    if word.endswith("ies") and len(word) > 4:
        return word[:-3] + "y"
    if word.endswith(("sses", "xes", "ches", "shes", "uses")):
        return word[:-2]
    if word.endswith("s") and not word.endswith(("ss", "us", "is")):
        return word[:-1]
    return word


def canonical(token: str) -> list[str]:
    """One token's words in one spelling: numbers without thousands commas, number words and ordinals as
    digits, synonyms and abbreviations to one word, a light plural stem."""
    if token[0].isdigit():
        found = _ORDINAL_DIGITS.match(token)
        return [f"{found.group(1)}th" if found else token.replace(",", "")]
    out = []
    for word in SYNONYMS.get(token, token.replace(".", "")).split():
        if word in _NUMBER_WORDS:
            out.append(_NUMBER_WORDS[word])
        elif word in _ORDINALS:
            out.append(_ORDINALS[word])
        else:
            stemmed = _stem(SYNONYMS.get(word, word))
            out.append(SYNONYMS.get(stemmed, stemmed))
    return out


@functools.lru_cache(maxsize=4096)
def content(text: str) -> tuple[tuple[str, int], ...]:
    """The prompt's content words in order, each with the index of its clause (split at , ; : . ! ?).
    Cached: one verdict reads each prompt's words several times, and a cached prompt is compared often."""
    lowered = _US.sub("united states", text).lower().replace("\u2019", "'").replace("\u2018", "'")
    for pattern, replacement in _CONTRACTIONS_PLAIN + (_CONTRACTIONS if "'" in lowered else ()):
        lowered = pattern.sub(replacement, lowered)
    for pattern, replacement in _PHRASES:
        lowered = pattern.sub(replacement, lowered)
    # a minus between numbers stays ("5-3"); any other hyphen splits words ("ten-year-old")
    lowered = _MINUS.sub(" \u2212 ", lowered).replace("-", " ").replace("\u2212", "-")
    out: list[tuple[str, int]] = []
    clause, at_start = 0, True
    for token in _TOKEN.findall(lowered):
        if token in _CLAUSE_END:
            clause, at_start = clause + 1, True
            continue
        if token in FILLER or (at_start and token in FRAMES):
            continue
        for word in canonical(token):
            if word in FILLER or (at_start and word in FRAMES):
                continue
            out.append((word, clause))
            at_start = False
    return tuple(out)


def typo(x: str, y: str) -> bool:
    """One word written for the other by a slip: two neighbouring letters swapped ("captial") or one
    letter left out or doubled ("populaton", "togeather" is not: that is a letter added elsewhere too).
    Both at least 4 letters and not numbers; a letter put for another ("affect" / "effect") is not a
    typo here, since many real words differ so."""
    if min(len(x), len(y)) < 4 or not (x.isalpha() and y.isalpha()):
        return False
    if len(x) == len(y):
        diff = [i for i in range(len(x)) if x[i] != y[i]]
        return len(diff) == 2 and diff[1] == diff[0] + 1 and x[diff[0]] == y[diff[1]] and x[diff[1]] == y[diff[0]]
    if abs(len(x) - len(y)) != 1:
        return False
    short, long_ = (x, y) if len(x) < len(y) else (y, x)
    return any(long_[:i] + long_[i + 1:] == short for i in range(len(long_)))


def negated(words: list[str]) -> bool:
    return sum(w in NEGATIONS for w in words) % 2 == 1


def numbers(text: str) -> tuple[str, ...]:
    """The prompt's numbers (number words as digits), sorted: the part of the semantic scope that both
    ways of matching require equal."""
    return tuple(sorted(w for w, _ in content(text) if w[0].isdigit()))


def same_words(a: str, b: str) -> bool:
    """Whether two prompts have the same content words (as many times each; one typo per side folded
    onto the other side's word), the same negation, and the same order within each clause both keep."""
    ca, cb = content(a), content(b)
    wa, wb = [w for w, _ in ca], [w for w, _ in cb]
    if not wa or not wb or negated(wa) != negated(wb):  # nothing read (another script): nothing verified
        return False
    only_a, only_b = Counter(wa) - Counter(wb), Counter(wb) - Counter(wa)
    fold: dict[str, str] = {}
    for x in list(only_a):
        for y in only_b:
            if only_a[x] == only_b[y] and y not in fold.values() and typo(x, y):
                fold[x] = y
                break
    if set(only_a) - set(fold) or set(only_b) - set(fold.values()):
        return False
    return in_order([(fold.get(w, w), c) for w, c in ca], cb)


def in_order(a: Sequence[tuple[str, int]], b: Sequence[tuple[str, int]]) -> bool:
    """Each pair of words that occur once on each side, in one clause on both sides, comes in the same
    order on both: a moved clause keeps its words' order, a swap ("kilograms to pounds" / "pounds to
    kilograms", "from Canada to the US" / "from the US to Canada") does not. Repeated words ("to" of
    "how to" and of "to pounds") are left out: their occurrences cannot be told apart."""
    pa, pb = _places(a), _places(b)
    common = [w for w in pa if w in pb and w not in NEGATIONS]  # "isn't printing" / "is not printing"
    for i, x in enumerate(common):
        for y in common[i + 1:]:
            if pa[x][0] == pa[y][0] and pb[x][0] == pb[y][0] and (pa[x][1] < pa[y][1]) != (pb[x][1] < pb[y][1]):
                return False
    return True


def _places(words: Sequence[tuple[str, int]]) -> dict[str, tuple[int, int]]:
    """word -> (clause, position), for the words that occur once."""
    counts = Counter(w for w, _ in words)
    return {w: (c, i) for i, (w, c) in enumerate(words) if counts[w] == 1}


# Words whose addition asks no more specific question: prepositions, conjunctions and question words
# ("grams in an ounce?" / "how many grams are in an ounce?").
LINKS = frozenset("""how many much who whom whose when where why whether if in on at of to for from into by with about
and or but as than vs per via""".split())


def added_only(a: str, b: str) -> bool:
    """Whether one prompt's content words are the other's plus more, one of them not a link word: a
    constraint added ("a good camera" / "a good camera for video", "... in Lisbon after midnight"), a
    more specific question."""
    ca, cb = Counter(w for w, _ in content(a)), Counter(w for w, _ in content(b))
    if ca == cb:
        return False
    extra = (cb - ca) if not (ca - cb) else (ca - cb) if not (cb - ca) else None
    return extra is not None and any(w not in LINKS and w not in NEGATIONS for w in extra)  # parity: negated()
