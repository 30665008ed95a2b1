"""What parsing a JSON body will cost, read off its bytes before json.loads: pure functions.

A 4 MiB body of `[{},{},...]` parses into about a million dicts, ~100 MB: the bytes a request
announces say little of what the router then holds. The scan blanks the strings out (split on
`"`, or one regular expression where a quote is escaped; C speed either way: a string's contents are
never structure), then counts what is left:
containers (`[`, `{`), values (at most one per `,` and `:`, plus one per container) and, only
when the containers are within their cap, the nesting depth. Limits bounds each (over), so that
neither the parse nor the engine's validation after it runs long on a body built to cost.
`estimate` turns those into bytes of Python objects, an upper bound measured on CPython 3.11
(tests/unit/operator/router/test_json_cost.py checks it against tracemalloc on the shapes that
cost most per byte).

Only UTF-8 bodies are scanned (RFC 8259 8.1): in UTF-8 no byte of a multi-byte character is an
ASCII one, so every `"`, `[`, `,` the scan sees is one the parser sees. json.loads would also
take UTF-16 and UTF-32, whose bytes the scan would misread; the router refuses those (parse).
"""
from __future__ import annotations

import re
from typing import NamedTuple

# A JSON string, escapes and all; the unrolled form runs at memchr-like speed on long strings.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_WIDE = re.compile(rb"[\xf0-\xf4]")  # the lead byte of a 4-byte UTF-8 character: a str of 4 bytes per char

# Bytes of Python objects per item, upper bounds on CPython 3.11 (64-bit), list or dict slots included.
PER_CONTAINER = 240  # an empty dict is 64, a dict of one key 184 (+8 for its slot); a list 56 + its slots
PER_VALUE = 64  # a float 24 or an int 28-36, a short string 50-60, plus its slot (8) or a dict entry


class Limits(NamedTuple):
    """What one request body may hold (refused with a 400 or 413 naming the limit, unparsed)."""

    depth: int = 128  # nested arrays and objects; deep schemas nest about 20
    containers: int = 1 << 16  # arrays and objects
    values: int = 1 << 20  # a 4 MiB prompt of token ids is about 700,000
    strings: int = 1 << 16  # counted as `"` / 2, escaped ones too: it bounds the scan's own work


DEFAULT = Limits()


class Shape(NamedTuple):
    strings: int  # at most (its `"` count / 2)
    containers: int
    values: int
    depth: int | None  # None: not measured (past a cap already)
    width: int  # bytes per character of the decoded text: 1 (ASCII), 2, or 4


def scan(body: bytes, limits: Limits = DEFAULT) -> Shape:
    """The body's shape, measured only as far as the limits: past the strings' cap nothing
    else is (the regular expression's work grows with the strings), past the containers' the depth
    is not."""
    quotes = body.count(b'"')
    strings = quotes // 2
    width = 1 if body.isascii() else 4 if _WIDE.search(body) else 2
    if strings > limits.strings:
        return Shape(strings, 0, 0, None, width)
    bare = skeleton(body, quotes)
    containers = bare.count(b"{") + bare.count(b"[")
    values = bare.count(b",") + bare.count(b":") + containers + 1
    depth = None if containers > limits.containers else _depth(bare.translate(None, _NOT_BRACKETS))
    return Shape(strings, containers, values, depth, width)


def skeleton(body: bytes, quotes: int) -> bytes:
    """The body with its strings' contents taken out: what is left is structure. With no escaped quote in it (no
    backslash before a `"`) and an even count of them, every `"` opens or closes a string in turn, so the odd
    pieces between them are the strings: split and joined, about twice as fast as the regular expression on a
    request's body, and the same counts (the brackets, `,` and `:` left are the same; only the `""` are not kept)."""
    if quotes % 2 == 0 and (b"\\" not in body or b'\\"' not in body):  # (one byte's search first: the quicker)
        return b"".join(body.split(b'"')[::2])
    return _STRING.sub(b'""', body)


def over(shape: Shape, limits: Limits = DEFAULT) -> tuple[int, str] | None:
    """The status and message refusing a body of this shape, or None."""
    if shape.strings > limits.strings:
        return 413, f"the request body holds more than {limits.strings} JSON strings"
    if shape.containers > limits.containers:
        return 413, f"the request body holds more than {limits.containers} JSON arrays and objects"
    if shape.values > limits.values:
        return 413, f"the request body holds more than {limits.values} JSON values"
    if shape.depth is not None and shape.depth > limits.depth:
        return 400, f"the request body nests JSON arrays and objects deeper than {limits.depth} levels"
    return None


def assess(body: bytes, limits: Limits = DEFAULT) -> tuple[int, tuple[int, str] | None]:
    """estimate(len(body), scan(body, limits)) and over(that shape, limits) in one pass, for the router's every
    request: the same counts and the same refusal, without the Shape in between, and without the depth where it
    cannot be over its limit (fewer arrays and objects than the limit allows levels). The estimate is 0 when the
    body is refused (it is not parsed then)."""
    quotes = body.count(b'"')
    if quotes // 2 > limits.strings:
        return 0, over(Shape(quotes // 2, 0, 0, None, 1), limits)
    bare = skeleton(body, quotes)
    containers = bare.count(b"{") + bare.count(b"[")
    values = bare.count(b",") + bare.count(b":") + containers + 1
    if containers > limits.containers or values > limits.values or (
            containers > limits.depth and _depth(bare.translate(None, _NOT_BRACKETS)) > limits.depth):
        return 0, over(scan(body, limits), limits)  # refused: the message as over() words it
    width = 1 if body.isascii() else 4 if _WIDE.search(body) else 2
    size = len(body)
    return size + 2 * width * size + PER_CONTAINER * containers + PER_VALUE * values, None


def _depth(brackets: bytes) -> int:
    deepest = level = 0
    for b in brackets:  # at most 2 x max_containers of them
        if b in (0x5B, 0x7B):
            level += 1
            deepest = max(deepest, level)
        else:
            level -= 1
    return deepest


def estimate(size: int, shape: Shape) -> int:
    """Bytes the router holds at most while it parses a body of `size` bytes of this shape and
    keeps the result: the body, its decoded text (freed after parsing, but held during it), the
    strings parsed out of it (at most as wide as the text) and the containers and values."""
    return size + 2 * shape.width * size + PER_CONTAINER * shape.containers + PER_VALUE * shape.values
