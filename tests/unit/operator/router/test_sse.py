"""The router's SSE framer (router/sse.py): bytes in as the engine sends them, whole events out."""
from __future__ import annotations

from kaon_operator.router.sse import EventFramer, Unframed

EVENTS = [b'data: {"choices": [{"text": "Hel"}]}\n\n', b"event: usage\ndata: {\"tokens\": 3}\n\n",
          b"data: [DONE]\n\n"]


def test_events_split_across_chunks_come_out_whole():
    framer = EventFramer()
    assert framer.feed(b'data: {"choices": [{"te') == b""
    assert framer.feed(b'xt": "Hel"}]}\n\ndata: [DO') == EVENTS[0]
    assert framer.feed(b"NE]\n") == b""  # half of the blank line that ends it
    assert framer.feed(b"\n") == EVENTS[2]
    assert framer.flush() == b""


def test_every_way_of_cutting_a_stream_writes_only_whole_events_and_loses_nothing():
    stream = b"".join(EVENTS)
    for size in range(1, len(stream) + 1):
        framer, out = EventFramer(), []
        for start in range(0, len(stream), size):
            if written := framer.feed(stream[start:start + size]):
                out.append(written)
        out.append(framer.flush())
        assert b"".join(out) == stream, size
        assert all(w.endswith(b"\n\n") for w in out if w), size
        # A multi-line event (event: + data:) is never cut at one of its own line ends.
        assert not any(w.endswith(b"usage\n") or w.startswith(b"data: {\"tokens\"") for w in out), size


def test_crlf_events_and_several_events_in_one_chunk():
    framer = EventFramer()
    assert framer.feed(b"data: a\r\n\r\ndata: b\r\n\r\ndata: c") == b"data: a\r\n\r\ndata: b\r\n\r\n"
    assert framer.feed(b"\r\n\r\n") == b"data: c\r\n\r\n"


def test_a_trailing_partial_event_is_held_until_the_body_ends():
    framer = EventFramer()
    assert framer.feed(EVENTS[0] + b"data: cut sho") == EVENTS[0]
    assert framer.pending == b"data: cut sho"
    assert framer.flush() == b"data: cut sho"  # the end of the body: passed on as it is
    assert framer.flush() == b"" and framer.pending == b""


def test_an_event_longer_than_the_limit_is_passed_on_in_pieces():
    framer = EventFramer(max_pending=16)
    assert framer.feed(b"data: " + b"x" * 9) == b""  # 15 bytes: held
    assert framer.feed(b"y") == b"data: " + b"x" * 9 + b"y"  # 16: too many to hold
    assert framer.pending == b""


def test_any_other_body_passes_as_it_comes():
    assert Unframed.feed(b"half an ev") == b"half an ev" and Unframed.flush() == b""
