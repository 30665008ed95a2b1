"""The semantic cache's guard (anchors.verdict / accepts, prompt_words) and the monitor's comparison of long
answers' facts (answer_facts, monitor.compare): the kinds of paraphrase the guard now verifies, the kinds of
near miss it still refuses, and answers that differ in one fact. Pure; the examples are written here (none
is taken from bench/data/heldout)."""
from __future__ import annotations

import pytest

from kaon_operator.routes import anchors, cache_keys, monitor
from kaon_operator.routes.api import SemanticCacheSpec

DEFAULT = SemanticCacheSpec()

SAME_WORDS = [  # (kind, cached prompt, new prompt)
    ("case and punctuation", "Is it safe to swim after eating?", "IS IT SAFE TO SWIM AFTER EATING?!"),
    ("contraction", "What is the tallest building in Dubai?", "whats the tallest building in dubai"),
    ("contraction", "Why can't my laptop find the printer?", "Why cannot my laptop find the printer"),
    ("politeness", "population of norway?", "Hi! Could you please tell me the population of Norway? Thanks so much!"),
    ("framing", "How do tides work?", "Explain how tides work."),
    ("clause moved", "How do I read a file in Rust?", "In Rust, how do I read a file?"),
    ("typo", "What is the capital of Norway?", "What is the captial of Norway?"),
    ("synonym", "How do I start learning guitar?", "How do I begin learning guitar?"),
    ("number word", "Gift ideas for a 10 year old", "present ideas for a ten-year-old"),
    ("plural", "How many legs does a spider have?", "How many legs do spiders have?"),
]

NEAR_MISSES = [  # (kind, cached prompt, new prompt): each needs another answer
    ("another name", "What is the capital of Norway?", "What is the capital of Sweden?"),
    ("another name, lowercase", "what is the capital of norway", "what is the capital of sweden"),
    ("another number", "Convert 5 miles to km", "Convert 6 miles to km"),
    ("swapped", "How do I convert kilograms to pounds?", "How do I convert pounds to kilograms?"),
    ("swapped around a filler", "Shipping cost from Canada to the US", "Shipping cost from the US to Canada"),
    ("negation", "Is it safe to eat raw eggs?", "Is it not safe to eat raw eggs?"),
    ("constraint added", "What's a good laptop?", "What's a good laptop for gaming?"),
    ("tense", "When was the bridge built?", "When will the bridge be built?"),
    ("one word put for another", "Give me arguments for remote work.", "Give me arguments against remote work."),
    ("operator", "What is 12+4?", "What is 12*4?"),
    ("another script", "Что такое кэш?", "Что такое куки?"),
]


@pytest.mark.parametrize(("kind", "cached", "prompt"), SAME_WORDS, ids=[k for k, _, _ in SAME_WORDS])
def test_paraphrases_that_change_only_the_form_hit_at_the_loose_cut_off(kind, cached, prompt):
    assert anchors.verdict(prompt, cached) == anchors.SAME_WORDS
    # A typo or a terse rewrite moves the embedding (all-MiniLM-L6-v2: 0.3-0.9): the loose cut-off admits it,
    # the route's threshold alone would not, and setting sameWordsThreshold to it restores one cut-off.
    assert anchors.accepts(prompt, cached, 0.6, DEFAULT.threshold, DEFAULT.same_words_threshold)
    assert not anchors.accepts(prompt, cached, 0.6, DEFAULT.threshold, DEFAULT.threshold)
    assert not anchors.accepts(prompt, cached, 0.3, DEFAULT.threshold, DEFAULT.same_words_threshold)


@pytest.mark.parametrize(("kind", "cached", "prompt"), NEAR_MISSES, ids=[k for k, _, _ in NEAR_MISSES])
def test_near_misses_are_refused_however_close_they_embed(kind, cached, prompt):
    assert anchors.verdict(prompt, cached) == anchors.REFUSED
    assert not anchors.accepts(prompt, cached, 0.999, DEFAULT.threshold, DEFAULT.same_words_threshold)


def test_prompts_in_other_words_need_the_routes_threshold():
    cached, prompt = "Who wrote Romeo and Juliet?", "Who is the author of romeo and juliet?"
    assert anchors.verdict(prompt, cached) == anchors.REWORDED  # names compared without their case
    assert anchors.accepts(prompt, cached, 0.96, DEFAULT.threshold, DEFAULT.same_words_threshold)
    assert not anchors.accepts(prompt, cached, 0.9, DEFAULT.threshold, DEFAULT.same_words_threshold)
    assert anchors.verdict("Who is the author of Hamlet?", cached) == anchors.REFUSED  # another name
    assert anchors.verdict(prompt, "") == anchors.REFUSED  # no prompt kept: no semantic match


def test_the_semantic_scope_holds_the_numbers_not_the_names_case():
    def scope(text: str) -> str:
        return cache_keys.semantic_scope("s", "g", "/v1/chat/completions",
                                         {"messages": [{"role": "user", "content": text}]}, text)
    assert scope("What's the weather in Paris in April?") == scope("whats the weather like in paris in april")
    assert scope("What is 17 times 24?") != scope("What is 17 times 23?")
    assert scope("Gift for a ten-year-old") == scope("gift for a 10 year old")


EIFFEL = ("The Eiffel Tower is about 330 metres tall. It was completed in 1889 as the entrance arch to the "
          "World's Fair, and it is the most visited paid monument in the world.")


def test_an_answer_that_changes_one_fact_in_the_same_words_disagrees():
    for changed in (EIFFEL.replace("330", "300"),  # a number
                    EIFFEL.replace("World's Fair", "Olympic Games"),  # a name
                    EIFFEL.replace("it is the most", "it is not the most")):  # a negation
        assert monitor.compare(changed, EIFFEL, 0.999, 0.77) == (False, "edited")
    # Rewording edits, and a fact moved within the text, keep the facts: agreeing, whatever the cosine.
    reworded = EIFFEL.replace("about 330 metres tall", "roughly 330 metres high").replace(
        "It was completed in 1889 as", "Completed in 1889, it served as")
    assert monitor.compare(reworded, EIFFEL, 0.5, 0.77) == (True, "edited")


def test_answers_written_separately_disagree_on_conflicting_numbers_else_by_cosine():
    a = "Most adults need about 2.7 litres of water a day for women and 3.7 litres for men, food included."
    b = "Every adult should drink exactly 8 glasses of plain water daily, no matter their size or the climate."
    assert monitor.compare(b, a, 0.95, 0.77) == (False, "numbers")
    c = "Women need roughly 2.7 litres of fluid daily and men about 3.7 litres, counting what food provides."
    assert monitor.compare(c, a, 0.9, 0.77) == (True, "embedding")
    assert monitor.compare(c, a, 0.7, 0.77) == (False, "embedding")
    assert monitor.compare(c, a, None, 0.77)[1] == "overlap"  # no embedder: word overlap, as before
