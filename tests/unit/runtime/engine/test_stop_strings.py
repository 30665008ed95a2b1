"""Stop strings: one split across two steps' text still ends the output, the first to complete wins,
and a stream never sends the part of a stop string it cannot yet tell from ordinary text.

The pure parts first, then the real engine (n > 1, include_stop_str_in_output, speculative
decoding), then its outputs replayed through the server's SSE stream; those whole-model tests
are marked slow (`make unit` runs only the pure ones).
"""
from __future__ import annotations

import asyncio
import json

import pytest

from kaon_runtime import LLM, SamplingParams
from kaon_runtime.engine.stop_strings import find_stop, held_back
from kaon_runtime.loader.tokenizer import IncrementalDetokenizer
from kaon_runtime.server.metrics import Metrics
from kaon_runtime.server.serving import CompletionFormat, Generation, sse_events
from support import MODEL

# Code the model copies, so prompt lookup's drafts are kept and a speculative step has several tokens.
CODE = ("def area(width, height):\n    return width * height\n\n\n"
        "def perimeter(width, height):\n    return 2 * (width + height)\n")
PROMPT = [{"role": "user", "content": "Fix the bug in this code: area should use width * height * 1. Reply with the "
           "complete file only.\n```python\n" + CODE + "```"}]


# ---- pure parts ------------------------------------------------------------------------------

def test_a_stop_string_split_across_steps_is_found_in_the_window():
    assert find_stop("say hel", 4, ["hello"]) is None  # not complete yet
    assert find_stop("say hello", 7, ["hello"]) == (4, 9)  # "hel" was there, "lo" is new
    assert find_stop("say hello there", 9, ["hello"]) is None  # ended before the new text: not new


def test_the_first_stop_string_to_complete_wins_whatever_the_order_of_the_list():
    # Both complete in the new text "cdb"; "c" ends first, so nothing of it may stay in the output.
    assert find_stop("xcdb", 1, ["db", "c"]) == (1, 2)
    assert find_stop("xabc", 1, ["bc", "abc"]) == (1, 4)  # the same end: the longer, so no stop is left


def test_the_stream_holds_back_the_longest_tail_that_may_become_a_stop_string():
    assert held_back("say hel", ["hello"]) == 3
    assert held_back("say he", ["hex", "help"]) == 2
    assert held_back("aaa", ["aab"]) == 2  # "aa", not "a"
    assert held_back("say", ["hello", "x"]) == 0
    assert held_back("hello", ["hello"]) == 0  # a whole stop string is the engine's to cut, not a prefix
    assert held_back("", ["ab"]) == 0


def test_the_hold_back_reads_only_the_tail_of_a_long_text():
    stops = ["x" * 255 + "y"] * 16  # the server's defaults: 16 stop strings of up to 256 characters
    assert held_back("x" * 1_000_000, stops) == 255
    assert held_back("z" * 1_000_000, stops) == 0


# ---- the engine -----------------------------------------------------------------------------

def pieces(llm, prompt_ids, token_ids):
    """Each token's new text, as the engine's detokenizer produces it step by step."""
    detok = IncrementalDetokenizer(llm.tokenizer, prompt_ids)
    return [detok.add(t) for t in token_ids]


def reference(llm):
    """The greedy output, its text by token, and where each token's text starts."""
    out = llm.generate([llm.encode_chat(PROMPT)], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
                       use_tqdm=False)[0]
    parts = pieces(llm, out.prompt_token_ids, out.outputs[0].token_ids)
    starts = [sum(map(len, parts[:i])) for i in range(len(parts))]
    return out.outputs[0].text, parts, starts


def split_stop(llm):
    """A stop string made of the end of one token's text and the start of the next's (late in the output,
    where drafts are kept)."""
    full, parts, starts = reference(llm)
    for i in reversed(range(1, len(parts) - 1)):
        stop = parts[i][-2:] + parts[i + 1][:2]
        if len(parts[i]) >= 2 and len(parts[i + 1]) >= 2 and full.find(stop) == starts[i + 1] - 2:
            return full, stop, starts[i + 1] - 2
    raise AssertionError(f"no two neighbouring tokens of two characters in {parts}")


def overlapping_stops(llm):
    """Two stop strings in one token's text, listed so that the one completing later comes first."""
    full, parts, starts = reference(llm)
    for part, start in reversed(list(zip(parts, starts))):
        early, late = part[:2], part[2:4]
        if len(part) >= 4 and full.find(early) == start and full.find(late) == start + 2:
            return full, [late, early], start
    raise AssertionError(f"no token of four characters in {parts}")


def generate(llm, stops, n=1, include=False):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=stops, n=n,
                            include_stop_str_in_output=include)
    return llm.generate([llm.encode_chat(PROMPT)], params, use_tqdm=False)[0].outputs


@pytest.mark.slow
def test_a_stop_string_split_across_two_tokens_ends_every_choice(llm):
    full, stop, at = split_stop(llm)
    for choice in generate(llm, [stop], n=2):
        assert (choice.finish_reason, choice.text) == ("stop", full[:at])
    assert [c.text for c in generate(llm, [stop], include=True)] == [full[:at + len(stop)]]


@pytest.mark.slow
def test_the_engine_cuts_at_the_stop_string_that_completes_first(llm):
    full, stops, at = overlapping_stops(llm)
    for choice in generate(llm, stops, n=2):
        assert (choice.finish_reason, choice.text) == ("stop", full[:at])
    assert [c.text for c in generate(llm, stops, include=True)] == [full[:at + len(stops[1])]]


@pytest.mark.slow
def test_stop_strings_with_speculative_decoding_several_tokens_a_step(llm):
    full, stop, at = split_stop(llm)
    _, stops, early_at = overlapping_stops(llm)
    spec = LLM(MODEL, show_progress=False, device="cpu", dtype="float32", speculative_method="ngram")
    try:
        for choice in generate(spec, [stop], n=2):
            assert (choice.finish_reason, choice.text) == ("stop", full[:at])
        for choice in generate(spec, stops, n=2, include=True):
            assert (choice.finish_reason, choice.text) == ("stop", full[:early_at + len(stops[1])])
        assert spec.engine.stats().spec_accepted_tokens > 0  # drafts were kept: steps of several tokens
    finally:
        spec.close()


# ---- the stream -----------------------------------------------------------------------------

class _Recorded:
    """A request stream that replays the engine's outputs, step by step."""

    def __init__(self, outputs):
        self._outputs = iter(outputs)

    def __aiter__(self):
        return self

    async def __anext__(self):
        try:
            return next(self._outputs)
        except StopIteration:
            raise StopAsyncIteration from None

    def abort(self):
        pass


def engine_steps(llm, request_id, params):
    engine = llm.engine
    engine.add_request(request_id, llm.encode_chat(PROMPT), params)
    steps = []
    while engine.has_unfinished_requests():
        steps += [o for o in engine.step() if o.request_id == request_id]
    return steps


def streamed_texts(llm, steps, stops, n):
    """What a client has received after each event, by choice."""
    gen = Generation("cmpl-test", "m", _Recorded(steps), Metrics(lambda: None).track(), stops, None)

    async def events():
        return [e async for e in sse_events(gen, CompletionFormat(gen, llm.tokenizer), n, False)]

    received, history = [""] * n, []
    for event in asyncio.run(events())[:-1]:
        for choice in json.loads(event.removeprefix("data: "))["choices"]:
            received[choice["index"]] += choice["text"]
        history.append(list(received))
    return history


@pytest.mark.slow
def test_a_stream_never_sends_the_start_of_a_stop_string(llm):
    full, stop, at = split_stop(llm)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[stop], n=2)
    steps = engine_steps(llm, "stream-split-stop", params)
    # The step before the stop completed ended with its first half: there was something to hold back.
    assert any(c.text.endswith(stop[:2]) for c in steps[-2].outputs)
    history = streamed_texts(llm, steps, [stop], n=2)
    for received in history:
        assert all(full[:at].startswith(text) for text in received), received
    assert history[-1] == [full[:at]] * 2
