"""What kaon reads off an OpenAI request body, shared by the engine's tools and the router.

A neutral package: it imports nothing of kaon's, so the operator image (operator/Dockerfile, built
from operator/ alone) and the engine image (runtime/Dockerfile) both carry it while kaon_operator
and kaon_runtime still never import each other (tests/unit/test_imports.py). Its one user on each
side: the router's request classifier (kaon_operator/routes/classifier.py) and `kaon route train`
(kaon_runtime/server/route_train.py), which must read a request's text the same way.
"""
from __future__ import annotations


def content_text(content: object) -> str:
    """A message's or a prompt's text: a string as is; a list of parts (strings, or OpenAI content
    parts with "text", or nested "content") joined by newlines; anything else (images, None) as ""."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(p if isinstance(p, str) else content_text(p.get("text") or p.get("content"))
                         if isinstance(p, dict) else "" for p in content)
    return ""
