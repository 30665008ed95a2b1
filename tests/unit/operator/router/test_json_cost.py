"""json_cost: its estimate is an upper bound of what json.loads holds (tracemalloc's peak), on the
shapes that cost most per byte and on ordinary ones; its counts are the parser's, strings and
escapes notwithstanding; and its own work stays small on a body built to slow it."""
from __future__ import annotations

import json
import tracemalloc

import pytest

from kaon_operator.router import json_cost

SIZE = 1 << 20


def filled(unit: bytes) -> bytes:
    head, tail = b'{"model": "m", "x": [', b"]}"
    return head + b",".join([unit] * ((SIZE - len(head) - len(tail)) // (len(unit) + 1))) + tail


SHAPES = {"empty dicts": filled(b"{}"), "empty lists": filled(b"[]"), "one-key dicts": filled(b'{"a":0}'),
          "floats": filled(b"0.5"), "token ids": filled(b"123456"), "short strings": filled(b'"ab"'),
          "nested": filled(b"[[[]]]"), "prose": json.dumps({"model": "m", "prompt": "hi, there. " * 90_000}).encode(),
          "wide prose": json.dumps({"model": "m", "prompt": "hi. " * 200_000 + "\U0001F600"},
                                   ensure_ascii=False).encode(),
          "chat": json.dumps({"model": "m", "messages": [{"role": "user", "content": "x" * 50}] * 2000}).encode()}
UNLIMITED = json_cost.Limits(depth=10**9, containers=10**9, values=10**9, strings=10**9)


@pytest.mark.parametrize("name", SHAPES)
def test_the_estimate_bounds_what_parsing_holds(name):
    body = SHAPES[name]
    estimate = json_cost.estimate(len(body), json_cost.scan(body, UNLIMITED))
    tracemalloc.start()
    try:
        parsed = json.loads(body.decode("utf-8", "surrogatepass"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    del parsed
    assert peak <= estimate <= max(8 * peak, 8 * len(body)), (name, peak, estimate)


def test_strings_hide_no_structure_and_escapes_do_not_end_them():
    body = b'{"model": "m", "p": "[{,:}] \\" [[[ \\\\", "q": [1, [2, {"a": 3}]]}'
    shape = json_cost.scan(body)
    assert json.loads(body)["p"] == '[{,:}] " [[[ \\'
    assert (shape.containers, shape.depth) == (4, 4) and shape.values >= 9


class _NotRun:
    def sub(self, *args):
        raise AssertionError("the string expression ran on a body past the strings' cap")


def test_limits_are_named_and_the_scan_stays_cheap_on_a_body_built_to_slow_it(monkeypatch):
    assert json_cost.over(json_cost.scan(b'{"a": ' + b"[" * 129 + b"]" * 129 + b"}")) == (
        400, "the request body nests JSON arrays and objects deeper than 128 levels")
    many_strings = b"[" + b",".join([b'"a"'] * 1_000_000) + b"]"
    # Refused on a count, not a million regex matches: the expression whose work grows with the strings
    # must not run at all (asserted as what runs, not as a time, which a busy machine stretches).
    monkeypatch.setattr(json_cost, "_STRING", _NotRun())
    shape = json_cost.scan(many_strings)
    assert (shape.strings, shape.containers, shape.depth) == (1_000_000, 0, None)
    assert json_cost.over(shape) == (413, "the request body holds more than 65536 JSON strings")


def test_the_split_skeleton_counts_what_the_string_expression_counts():
    """scan blanks strings by splitting on `"` where no quote is escaped: the same structure as the regular
    expression's, on bodies whose strings hold brackets, commas, colons, escapes, and on malformed ones."""
    import random
    rng = random.Random(5)
    pieces = ["[", "]", "{", "}", ",", ":", " ", "a", "\\n", "\\\\", "\"", "é", "\U0001F600"]

    def text() -> str:
        return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))

    def value(depth: int):
        kind = rng.randint(0, 4 if depth < 4 else 2)
        if kind == 0:
            return text()
        if kind == 1:
            return rng.randint(-5, 10**6)
        if kind == 2:
            return None
        if kind == 3:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {text(): value(depth + 1) for _ in range(rng.randint(0, 4))}

    split = 0
    for i in range(3000):
        body = json.dumps({"model": "m", "x": value(0)}, ensure_ascii=bool(i % 2)).encode()
        if i % 7 == 0:  # malformed too: cut short, an odd quote
            body = body[:rng.randint(0, len(body))]
        bare, expected = json_cost.skeleton(body, body.count(b'"')), json_cost._STRING.sub(b'""', body)
        split += b'\\"' not in body and body.count(b'"') % 2 == 0
        assert bare.replace(b'""', b"") == expected.replace(b'""', b""), body
    assert split > 2000  # most bodies took the split path: it is the one being checked


def test_assess_is_the_scan_its_refusal_and_its_estimate():
    """The router's one-pass assess: the same refusal as over(scan) and the same estimate, on bodies under and over
    each limit (the depth it skips where it cannot be over: fewer containers than levels allowed)."""
    import random
    rng = random.Random(7)
    tight = json_cost.Limits(depth=3, containers=6, values=20, strings=5)
    bodies = [*SHAPES.values(), b'{"a": ' + b"[" * 129 + b"]" * 129 + b"}", b"[" * 5 + b"]" * 5, b"[[[[", b'"\\"',
              b'{"p": "[[[[[[[[", "q": [[[1]]]}', b'{"p": "\\" [[[[[[ ", "q": 1}', b""]
    for _ in range(2000):
        bodies.append(bytes(rng.choice(b'[]{},:"\\ a1') for _ in range(rng.randint(0, 40))))
    for body in bodies:
        for limits in (json_cost.DEFAULT, tight):
            shape = json_cost.scan(body, limits)
            refusal = json_cost.over(shape, limits)
            expected = (0, refusal) if refusal is not None else (json_cost.estimate(len(body), shape), None)
            assert json_cost.assess(body, limits) == expected, (body, limits)
