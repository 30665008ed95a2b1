"""A cached answer: the response as the engine sent it, so a hit replays it byte for byte, and
what the route's figures need (tier, tokens). Serialized to JSON for a shared store."""
from __future__ import annotations

import base64
import json
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    content_type: str
    chunks: tuple[bytes, ...]
    """The body as written: one chunk for a JSON body, one per SSE event for a stream."""
    tier: str
    tokens: int
    """Prompt plus completion tokens the engine counted (its `usage`), 0 when it gave none."""
    prompt: str = ""
    """The request's prompt text, kept when the route's semantic cache is on: a semantic match must
    pass anchors.may_match against it ("" for an exact-only entry: never a semantic match)."""

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def dumps(self) -> bytes:
        return json.dumps({"status": self.status, "contentType": self.content_type, "tier": self.tier,
                           "tokens": self.tokens, "prompt": self.prompt,
                           "chunks": [base64.b64encode(c).decode() for c in self.chunks]}).encode()

    @classmethod
    def loads(cls, data: bytes) -> Answer:
        d = json.loads(data)
        return cls(int(d["status"]), str(d["contentType"]), tuple(base64.b64decode(c) for c in d["chunks"]),
                   str(d["tier"]), int(d["tokens"]), str(d.get("prompt", "")))


def usage_tokens(chunks: tuple[bytes, ...] | list[bytes], stream: bool) -> int:
    """total_tokens of the response's `usage` (a stream's last event that carries one), else 0."""
    if not stream:
        return _total(_json(b"".join(chunks)))
    for chunk in reversed(chunks):
        for line in chunk.splitlines():
            if line.startswith(b"data:") and b"usage" in line:
                found = _total(_json(line[5:].strip()))
                if found:
                    return found
    return 0


def stream_whole(chunks: tuple[bytes, ...] | list[bytes]) -> bool:
    """Whether a stream ended as an answer does: its last event `[DONE]` and no event an error. An engine
    that fails part way sends an error event, then ends (kaon's) or sends `[DONE]` (vLLM's): relayed as it
    came, but never a cache entry (it would be replayed to every identical request until its TTL)."""
    events = [line[5:].strip() for chunk in chunks for line in chunk.splitlines() if line.startswith(b"data:")]
    if not events or events[-1] != b"[DONE]":
        return False
    for event in events[:-1]:
        if b"error" in event:  # (the parse only where the word is: an answer's text may hold it too)
            body = _json(event)
            if body is not None and ("error" in body or body.get("object") == "error"):
                return False
    return True


def answer_text(chunks: tuple[bytes, ...] | list[bytes], stream: bool) -> str:
    """The answer's text (the first choice's): what the quality monitor compares."""
    if not stream:
        return _choice_text(_json(b"".join(chunks)))
    parts = []
    for chunk in chunks:
        for line in chunk.splitlines():
            if line.startswith(b"data:") and line[5:].strip() != b"[DONE]":
                event = _json(line[5:].strip())
                for choice in (event or {}).get("choices") or ():
                    if isinstance(choice, dict) and choice.get("index", 0) == 0:
                        delta = choice.get("delta") or {}
                        parts.append(str(delta.get("content") or choice.get("text") or ""))
    return "".join(parts)


def _choice_text(body: dict | None) -> str:
    for choice in (body or {}).get("choices") or ():
        if isinstance(choice, dict):
            message = choice.get("message") or {}
            return str(message.get("content") or choice.get("text") or "")
    return ""


def _json(data: bytes) -> dict | None:
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _total(body: dict | None) -> int:
    usage = (body or {}).get("usage")
    if not isinstance(usage, dict):
        return 0
    total = usage.get("total_tokens")
    if isinstance(total, int):
        return total
    return sum(v for k, v in usage.items() if k in ("prompt_tokens", "completion_tokens") and isinstance(v, int))
