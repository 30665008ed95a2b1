"""A request's prompt as prefix keys: chained hashes of its chunks, and its anchor on the ring.

The router has no tokenizer, so the prompt is hashed by characters: chunks of CHUNK_CHARS,
each chunk's hash chained to its parent's, like the engine's block hashes (which chain token
blocks). Two prompts that share their first k chunks share the first k hashes.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import NamedTuple

CHUNK_CHARS = 256


def stable_hash(data: bytes) -> int:
    """64 bits, the same in every process (unlike hash()), so that every router replica agrees."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def chain(text: str, salt: str = "", chunk: int = CHUNK_CHARS) -> list[int]:
    """The chained hashes of the text's chunks: one per full chunk, and one for a partial
    tail (so that a short prompt has a key too). `salt` (the InferenceService) keeps services
    apart."""
    hashes, parent = [], stable_hash(salt.encode())
    for start in range(0, len(text), chunk):
        parent = stable_hash(parent.to_bytes(8, "big") + text[start:start + chunk].encode("utf-8", "surrogatepass"))
        hashes.append(parent)
    return hashes


def _canonical(message) -> str:
    return json.dumps(message, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def prompt_prefix(path: str, payload: Mapping) -> tuple[str, str] | None:
    """(the text whose prefix the engine will cache, the anchor text for the ring), or None
    when the request carries no prompt the router understands (it then goes by least
    connections). Chat: the messages up to and including the last user turn, each as
    canonical JSON on its own line (what follows the last user turn is not in the cache of
    an earlier turn); the anchor stops at the first user turn. Completions: the prompt."""
    if path.endswith("/chat/completions"):
        messages = payload.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        users = [i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user"]
        first, last = (users[0], users[-1]) if users else (len(messages) - 1, len(messages) - 1)
        lines = [_canonical(m) for m in messages[:last + 1]]
        return "\n".join(lines), "\n".join(lines[:first + 1])
    if path.endswith("/completions"):
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt = ",".join(map(str, prompt))  # token ids: a prefix of ids is a prefix of this text
        if isinstance(prompt, str) and prompt:
            return prompt, prompt
    return None


class Prefix(NamedTuple):
    hashes: list[int]
    """The chained chunk hashes of the prompt."""
    anchor: int
    """Where the request sits on the ring."""
    own_from: int
    """The first chunk that belongs to this request alone (not to the anchor's text)."""


def prefix(path: str, payload: Mapping, salt: str) -> Prefix | None:
    """The request's prefix keys (None: no prompt to go by). A raw completion's anchor is its
    whole prompt, and its chunks from the second on count when known."""
    found = prompt_prefix(path, payload)
    if found is None:
        return None
    text, anchor = found
    hashes = chain(text, salt)
    if not path.endswith("/chat/completions"):
        return Prefix(hashes, hashes[-1], 1)
    anchored = chain(anchor, salt)
    return Prefix(hashes, anchored[-1], len(anchored) - 1)
