"""The prompts the correctness tests and their GPU and tensor-parallel variants share."""
from __future__ import annotations

from kaon_runtime import LLM

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about Kubernetes.",
    "Explain in one sentence what a KV cache is.",
    "List three prime numbers greater than 100.",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is 17 * 23?",
    "Write a Python function that reverses a string.",
    "Who wrote 'Pride and Prejudice'?",
    "Give me a short motivational quote.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
    "What does HTTP status code 429 mean?",
    "Name the planets of the solar system in order from the sun.",
    "Hi!",
    "Describe the colour blue to someone who cannot see, using the senses of touch and sound, "
    "in a gentle and poetic way, in no more than four sentences, and end with a question.",
    "Is a tomato a fruit or a vegetable? Explain briefly.",
    "Écris une phrase sur la mer. 🌊",
    "What is the difference between a list and a tuple in Python?",
    "Convert 100 degrees Fahrenheit to Celsius.",
    "Tell me a fun fact about octopuses.",
    "Suggest a name for a grey cat.",
    "What year did the first person walk on the moon?",
    "Write a SQL query that counts the rows of a table named users.",
]


MAX_TOKENS = 24


def chat_ids(llm: LLM, question: str, system: str | None = None) -> list[int]:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return llm.encode_chat(messages)
