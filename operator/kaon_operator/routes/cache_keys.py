"""What the response cache may hold and under which key. Pure.

A key is the SHA-256 of (scope, generation, path, the normalized request):
- scope: the namespace, the route and the digest of the caller's API key ("" for none), so no entry
  is ever read across namespaces, routes or keys;
- generation: a digest of the tiers' models (each InferenceService's spec.model), so a changed model
  makes every earlier entry unreachable (they age out by TTL and the size bound);
- the normalized request: its JSON with sorted keys, less `model` (the route's name: a `ns/name` and a
  bare spelling are the same request) and `user` (an end-user id for abuse tracking, not an input).
  `stream` stays in: a streamed request is replayed as the stream it was stored as.
"""
from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable

from kaon_operator.routes.prompt_words import numbers

IGNORED_FIELDS = frozenset({"model", "user"})


def deterministic(payload: dict) -> bool:
    """Whether the answer is fixed by the request: temperature 0, or a fixed seed. OpenAI's default
    temperature is 1, so a request without one is sampled."""
    temperature = payload.get("temperature")
    if isinstance(temperature, int | float) and not isinstance(temperature, bool) and temperature == 0:
        return True
    seed = payload.get("seed")
    return isinstance(seed, int) and not isinstance(seed, bool)


def cacheable(payload: dict, deterministic_only: bool) -> bool:
    return deterministic(payload) or not deterministic_only


def scope(namespace: str, route: str, key_digest: bytes | None) -> str:
    return f"{namespace}/{route}/{key_digest.hex() if key_digest else '-'}"


def generation(models: Iterable[str]) -> str:
    """A short digest of the tiers' model fingerprints, in tier order."""
    return hashlib.sha256("\0".join(models).encode()).hexdigest()[:16]


def normalized(payload: dict) -> bytes:
    kept = {k: v for k, v in payload.items() if k not in IGNORED_FIELDS}
    return json.dumps(kept, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode("utf-8",
                                                                                              "surrogatepass")


def exact_key(scope_: str, generation_: str, path: str, payload: dict) -> str:
    h = hashlib.sha256()
    for part in (scope_.encode(), generation_.encode(), path.encode()):
        h.update(part)
        h.update(b"\0")
    h.update(normalized(payload))
    return h.hexdigest()


def semantic_scope(scope_: str, generation_: str, path: str, payload: dict, text: str) -> str:
    """Where a semantic match may come from: the same scope and generation, and the same request but for
    its prompt text (its sampling parameters, tools, format, stream): a paraphrase shares an answer,
    a request asking for another format does not. And the same numbers (sorted; number words as digits:
    prompt_words.numbers), which the near-miss guard (anchors.verdict) requires equal in every match: the
    embedding decides only among prompts about the same quantities. Names are compared by the guard, not
    here: they may differ in case ("Paris" / "paris") between a prompt and its paraphrase."""
    rest = {k: v for k, v in payload.items() if k not in ("messages", "prompt", "input")}
    rest["\0numbers"] = list(numbers(text))
    return exact_key(scope_, generation_, path, rest)
