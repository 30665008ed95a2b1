"""Writes bench/data/routing_near_misses.jsonl: pairs of questions that differ in one way that changes
the answer (another entity, number, direction, polarity, language or unit), the semantic cache's
false-hit test set. Templates x values, so the set is reproducible and large enough to bound a 1%
rate (0 false hits in N pairs bounds the rate below 1 - 0.05**(1/N) at 95%: 0.75% for N = 400).

    .venv/bin/python bench/data/make_near_misses.py     # rewrites the .jsonl beside it
"""
from __future__ import annotations

import itertools
import json
from pathlib import Path

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Portugal", "Japan", "China", "India", "Brazil", "Argentina",
             "Canada", "Mexico", "Egypt", "Kenya", "Nigeria", "Australia", "Sweden", "Norway", "Poland", "Greece",
             "Turkey", "Peru", "Chile", "Vietnam", "Thailand"]
CITIES = ["Paris", "London", "Tokyo", "New York", "Sydney", "Cairo", "Moscow", "Berlin", "Madrid", "Rome",
          "Toronto", "Mumbai", "Beijing", "Lagos", "Lima", "Seoul"]
BOOKS = [("Hamlet", "Shakespeare"), ("Pride and Prejudice", "Austen"), ("War and Peace", "Tolstoy"),
         ("Moby Dick", "Melville"), ("1984", "Orwell"), ("The Odyssey", "Homer"), ("Don Quixote", "Cervantes"),
         ("Ulysses", "Joyce"), ("Dracula", "Stoker"), ("Frankenstein", "Shelley"), ("Beloved", "Morrison"),
         ("Lolita", "Nabokov"), ("The Trial", "Kafka"), ("Faust", "Goethe")]
LANGUAGES = ["Python", "JavaScript", "Java", "C++", "Rust", "Go", "Ruby", "C#", "Haskell", "Kotlin"]
TASKS = ["sort a list", "reverse a string", "read a file line by line", "parse JSON", "start a thread",
         "open a TCP socket"]
ELEMENTS = ["hydrogen", "helium", "carbon", "nitrogen", "oxygen", "iron", "gold", "silver", "copper", "sodium"]
PLANETS = ["Mercury", "Venus", "Earth", "Mars", "Jupiter", "Saturn", "Uranus", "Neptune"]
FOODS = [("high in protein", "low in protein"), ("high in fiber", "low in fiber"), ("high in sugar", "low in sugar"),
         ("rich in iron", "poor in iron"), ("good for sleep", "bad for sleep"), ("safe for dogs", "toxic to dogs")]
SUPERLATIVES = [("largest", "smallest"), ("fastest", "slowest"), ("heaviest", "lightest"), ("tallest", "shortest"),
                ("oldest living", "youngest living"), ("loudest", "quietest")]
TOPICS = ["remote work", "nuclear power", "electric cars", "social media", "homeschooling", "open-plan offices"]
UNITS = [("miles", "kilometers"), ("pounds", "kilograms"), ("Celsius", "Fahrenheit"), ("inches", "centimeters"),
         ("gallons", "liters"), ("feet", "meters")]


def pairs() -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []

    def add(kind: str, a: str, b: str) -> None:
        out.append((kind, a, b))

    for a, b in itertools.pairwise(COUNTRIES):
        add("entity", f"What is the capital of {a}?", f"What is the capital of {b}?")
        add("entity", f"What is the population of {a}?", f"What is the population of {b}?")
        add("entity", f"What is the national dish of {a}?", f"What is the national dish of {b}?")
    for a, b in itertools.pairwise(CITIES):
        add("entity", f"What is the weather like in {a} in winter?", f"What is the weather like in {b} in winter?")
        add("entity", f"What time zone is {a} in?", f"What time zone is {b} in?")
    for (a, _), (b, _) in itertools.pairwise(BOOKS):
        add("entity", f"Who wrote {a}?", f"Who wrote {b}?")
        add("entity", f"Summarize the plot of {a}.", f"Summarize the plot of {b}.")
    for task in TASKS:
        for a, b in itertools.pairwise(LANGUAGES):
            add("language", f"How do I {task} in {a}?", f"How do I {task} in {b}?")
    for a, b in itertools.pairwise(ELEMENTS):
        add("entity", f"What is the atomic number of {a}?", f"What is the atomic number of {b}?")
        add("entity", f"What is the melting point of {a}?", f"What is the melting point of {b}?")
    for a, b in itertools.pairwise(PLANETS):
        add("entity", f"How far is {a} from the Sun?", f"How far is {b} from the Sun?")
        add("entity", f"How many moons does {a} have?", f"How many moons does {b} have?")
    for x in (12, 17, 23, 38, 46, 59, 64, 77, 85, 93):
        add("number", f"What is {x} times {x + 7}?", f"What is {x} times {x + 8}?")
        add("number", f"What is {x} plus {3 * x}?", f"What is {x} minus {3 * x}?")
        add("number", f"How many minutes are in {x} hours?", f"How many seconds are in {x} hours?")
        add("number", f"What is the square root of {x * x}?", f"What is the square of {x * x}?")
        add("number", f"What is {x} percent of 250?", f"What is {x + 5} percent of 250?")
    for a, b in UNITS:
        for n in (5, 12, 40):
            add("direction", f"Convert {n} {a} to {b}.", f"Convert {n} {b} to {a}.")
    for a, b in FOODS:
        add("polarity", f"Which foods are {a}?", f"Which foods are {b}?")
    for a, b in SUPERLATIVES:
        add("polarity", f"What is the {a} animal in the world?", f"What is the {b} animal in the world?")
        add("polarity", f"Which is the {a} bird?", f"Which is the {b} bird?")
    for topic in TOPICS:
        add("polarity", f"What are the advantages of {topic}?", f"What are the disadvantages of {topic}?")
        add("polarity", f"Give me arguments for {topic}.", f"Give me arguments against {topic}.")
    for a, b in zip(COUNTRIES[:12], COUNTRIES[12:24]):
        add("direction", f"Is {a} bigger than {b}?", f"Is {b} bigger than {a}?")
        add("direction", f"How do I fly from {a} to {b}?", f"How do I fly from {b} to {a}?")
    for a, b in (("English", "French"), ("Spanish", "German"), ("Italian", "Japanese"), ("Chinese", "Russian")):
        for word in ("hello", "thank you", "good night"):
            add("direction", f"Translate '{word}' from {a} to {b}.", f"Translate '{word}' from {b} to {a}.")
    for year in (1914, 1939, 1969, 1989, 2001):
        add("number", f"What happened in {year}?", f"What happened in {year + 1}?")
        add("number", f"Who was the US president in {year}?", f"Who was the US president in {year + 12}?")
    for verb_a, verb_b in (("install", "uninstall"), ("enable", "disable"), ("encrypt", "decrypt"),
                           ("compress", "decompress"), ("upload", "download"), ("start", "stop")):
        for thing in ("a package on Ubuntu", "a service on Windows"):
            add("polarity", f"How do I {verb_a} {thing}?", f"How do I {verb_b} {thing}?")
    return out


def main() -> None:
    rows = [{"kind": k, "prompt": a, "near_miss": b} for k, a, b in pairs()]
    assert len({(r["prompt"], r["near_miss"]) for r in rows}) == len(rows), "duplicate pairs"
    path = Path(__file__).with_name("routing_near_misses.jsonl")
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{len(rows)} pairs -> {path}")


if __name__ == "__main__":
    main()
