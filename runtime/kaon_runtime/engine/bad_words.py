"""vLLM's SamplingParams.bad_words as token ids, from the model's tokenizer.

Each word is tokenized as it is and with one leading space (the same word mid-sentence is usually other
tokens); the spaced form is kept where it is a different sequence of the same length, as vLLM does. The
sampler (layers/penalties.bad_word_bans) then bans what would complete one of them.
"""
from __future__ import annotations

from kaon_runtime.loader.tokenizer import Tokenizer


def bad_words_token_ids(tokenizer: Tokenizer, words: list[str]) -> list[list[int]]:
    found: list[list[int]] = []
    for word in words:
        plain = tokenizer.backend.encode(word.lstrip(), add_special_tokens=False).ids
        spaced = tokenizer.backend.encode(" " + word.lstrip(), add_special_tokens=False).ids
        if plain:
            found.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            found.append(spaced)
    return found
