"""Stop strings: where one ends a growing text, and how much of its tail a stream must hold back.

Both look only at a window at the end of the text, no wider than the longest stop string plus the
newly decoded characters, so a step costs the same whether the output is ten characters long or
ten thousand (the text is never rescanned from its start).
"""
from __future__ import annotations

from collections.abc import Sequence


def find_stop(text: str, new_from: int, stops: Sequence[str]) -> tuple[int, int] | None:
    """The stop string that completes first in `text`, whose characters from `new_from` on are new:
    its (start, end), or None.

    A stop string that ended before `new_from` would have ended the output already, so only one that
    ends in the new characters can match; it may begin up to len(stop) - 1 characters before them
    (a stop string split across two steps' text). Among several, the one a reader of the text
    character by character would meet first wins: the earliest end, then the longest. Taking
    them in the request's order instead could cut after a stop string that ends sooner, leaving it
    in the output.
    """
    first: tuple[int, int] | None = None
    for stop in stops:
        start = text.find(stop, max(0, new_from - len(stop) + 1))
        if start >= 0:
            end = start + len(stop)
            if first is None or (end, start) < (first[1], first[0]):
                first = (start, end)
    return first


def held_back(text: str, stops: Sequence[str]) -> int:
    """How many characters at the end of `text` a stream must not send yet: the longest suffix that
    is a proper prefix of some stop string (it may still become that stop string, which is cut).

    Only the last len(stop) - 1 characters can start such a suffix; of the places there where the
    stop string's first character occurs, the leftmost that matches is the longest.
    """
    hold = 0
    end = len(text)
    for stop in stops:
        at = text.find(stop[0], max(0, end - len(stop) + 1), end - hold)
        while at >= 0:
            if stop.startswith(text[at:]):
                hold = end - at
                break
            at = text.find(stop[0], at + 1, end - hold)
    return hold
