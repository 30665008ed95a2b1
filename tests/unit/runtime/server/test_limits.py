"""What one request may cost the engine (server/limits.py): each limit refuses with a 400 that
names it, before the prompt is tokenized; a full queue refuses before tokenizing too."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from kaon_runtime.cli import build_parser
from kaon_runtime.errors import InvalidRequestError, QueueFullError
from kaon_runtime.server import protocol as p
from kaon_runtime.server.limits import Admission, Limits, check_chat, check_completion

LIMITS = Limits(max_stop=4, max_stop_chars=8, max_logprob_entries=1000)
CONTEXT = 100


def completion(**fields) -> p.CompletionRequest:
    return p.CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


def chat(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                   **fields})


def refused(check, *args) -> str:
    with pytest.raises(InvalidRequestError) as exc:
        check(*args)
    return str(exc.value)


def test_a_prompt_too_long_by_its_bytes_is_refused_before_tokenizing():
    assert LIMITS.prompt_bytes_limit(CONTEXT) == 3200  # 32 bytes a token at most
    check_completion(completion(), "x" * 3200, LIMITS, CONTEXT)
    assert "3201 bytes" in refused(check_completion, completion(), "x" * 3201, LIMITS, CONTEXT)
    assert "--max-prompt-bytes" in refused(check_completion, completion(), "é" * 1601, LIMITS, CONTEXT)  # bytes
    assert "101 tokens" in refused(check_completion, completion(), [1] * 101, LIMITS, CONTEXT)
    big = [{"role": "user", "content": "x" * 2000}, {"role": "user", "content": [{"type": "text", "text": "y" * 1201}]}]
    assert "3201 bytes" in refused(check_chat, chat(messages=big), None, LIMITS, CONTEXT)
    assert "--max-prompt-bytes" in refused(check_completion, completion(), "x" * 11, Limits(max_prompt_bytes=10),
                                           CONTEXT)


def test_stop_strings_are_capped_in_number_and_length():
    check_completion(completion(stop=["a", "b", "c", "d"]), "hi", LIMITS, CONTEXT)
    assert "--max-stop)" in refused(check_completion, completion(stop=list("abcde")), "hi", LIMITS, CONTEXT)
    assert "--max-stop-chars" in refused(check_chat, chat(stop="123456789"), None, LIMITS, CONTEXT)


def test_log_probability_entries_are_capped():
    check_chat(chat(n=2, logprobs=True, top_logprobs=4, max_tokens=100), 100, LIMITS, CONTEXT)  # 1000
    message = refused(check_chat, chat(n=2, logprobs=True, top_logprobs=4), 101, LIMITS, CONTEXT)
    assert "1010" in message and "--max-logprob-entries" in message
    assert "--max-logprob-entries" in refused(check_chat, chat(logprobs=True, top_logprobs=20), None,
                                              Limits(max_logprob_entries=2000), CONTEXT)  # None: the context
    check_chat(chat(n=128, max_tokens=10**6), 10**6, LIMITS, CONTEXT)  # no logprobs asked: nothing to cap
    assert "--max-logprob-entries" in refused(check_completion, completion(logprobs=5, n=4, max_tokens=50), "hi",
                                              LIMITS, CONTEXT)


def test_a_full_queue_refuses_before_the_prompt_is_prepared():
    engine = SimpleNamespace(max_queue=2, stats=lambda: SimpleNamespace(num_waiting=1))
    admission = Admission(engine)
    with admission.slot():
        assert admission.preparing == 1
        with pytest.raises(QueueFullError):  # one waiting in the engine, one being tokenized
            with admission.slot():
                pass
    assert admission.preparing == 0
    with admission.slot():
        pass


def test_scored_prompt_tokens_count_against_the_logprob_cap():
    from kaon_runtime.sampling import SamplingParams
    from kaon_runtime.server.limits import check_prompt_logprobs

    check_prompt_logprobs(10**6, SamplingParams(max_tokens=1), LIMITS, CONTEXT)  # the prompt is not scored
    check_prompt_logprobs(50, SamplingParams(max_tokens=0, prompt_logprobs=19), LIMITS, CONTEXT)  # 20 x 50
    message = refused(check_prompt_logprobs, 51, SamplingParams(max_tokens=0, prompt_logprobs=19), LIMITS, CONTEXT)
    assert "1020" in message and "--max-logprob-entries" in message
    # Generated entries add up with the prompt's: 20 x 40 + 2 x 100 = 1000, then one more generated token.
    check_prompt_logprobs(40, SamplingParams(max_tokens=100, logprobs=1, prompt_logprobs=19), LIMITS, CONTEXT)
    assert "--max-logprob-entries" in refused(check_prompt_logprobs, 40, SamplingParams(
        max_tokens=101, logprobs=1, prompt_logprobs=19), LIMITS, CONTEXT)
    # max_tokens None: the generated tokens fill the rest of the context, 2 x (100 - 40).
    check_prompt_logprobs(40, SamplingParams(max_tokens=None, logprobs=1, prompt_logprobs=19), LIMITS, CONTEXT)


def test_max_tokens_0_is_no_generated_logprob_entries():
    cap = Limits(max_logprob_entries=10)
    echo = dict(echo=True, logprobs=5)
    check_completion(completion(**echo, max_tokens=0), "hi", cap, CONTEXT)  # 0 entries: accepted
    # the bug it guards: 0 read as no max_tokens (the rest of the context), 600 entries, refused
    assert "600 log-probability entries" in refused(check_completion, completion(**echo, max_tokens=None), "hi",
                                                    cap, CONTEXT)
    assert "12 log-probability entries" in refused(check_completion, completion(**echo, max_tokens=2), "hi",
                                                   cap, CONTEXT)


@pytest.mark.parametrize("flags", [["--max-queue", "0"], ["--max-queue", "-1"], ["--max-queue-wait", "-5"],
                                   ["--max-queue-wait", "nan"]])
def test_an_admission_flag_that_would_refuse_or_expire_every_request_is_refused_at_start(flags, capsys):
    """--max-queue 0 answered every request 429 (nothing may wait, not even on an idle server), a negative
    --max-queue-wait expired every request at once (503), nan was no limit at all: each a server that
    starts, loads its model and then refuses its work. (--max-queue-wait 0 is the documented "no limit".)"""
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["serve", *flags])
    assert exited.value.code == 2
    assert f"argument {flags[0]}:" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--max-queue", "1", "--max-queue-wait", "0"]).max_queue_wait == 0
