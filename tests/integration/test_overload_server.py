"""An overloaded `kaon serve` finishes the oldest requests and answers every other one clearly (issue 49 §6).

One running slot (--max-num-seqs 1) and an admission limit of 1 s (--max-queue-wait): the first request,
long enough to hold its slot well past the limit, runs to its end; the ones sent while it runs wait for
their turn past the limit and each gets a 503 with a Retry-After and OpenAI's error body, a streamed one
included (as its status, not as an event inside a 200 stream), a queue of 3 (--max-queue) turns the
surplus away with a 429 at once, and no request is left without an answer. Before the limit existed every
queued request waited, whatever its client's patience, and a streamed one got its 200 head at once.
"""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from support.server import MODEL, Server, error_body

LONG = 96  # tokens: seconds on any CPU, well past the 1 s limit


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("overload"), "--max-num-seqs", "1", "--max-queue-wait", "1",
                 "--max-queue", "3")
    yield srv
    srv.stop()


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": stream}


@pytest.mark.slow
def test_the_oldest_request_finishes_and_every_queued_one_gets_an_answer(server):
    first_token = threading.Event()
    oldest: dict = {}

    def run_oldest() -> None:
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body(LONG, stream=True), timeout=300) as r:
            oldest["status"] = r.status_code
            chunks = []
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    first_token.set()
                elif line == "data: [DONE]":
                    oldest["done"] = True
            oldest["tokens"] = len(chunks)
        first_token.set()

    thread = threading.Thread(target=run_oldest)
    thread.start()
    assert first_token.wait(120), "the first request never started"
    answers: list[httpx.Response] = [None] * 6  # type: ignore[list-item]

    def send(i: int) -> None:
        answers[i] = httpx.post(f"{server.url}/v1/completions", json=body(4, stream=i == 0), timeout=120)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(len(answers))]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(150)
    thread.join(300)

    assert oldest == {"status": 200, "done": True, "tokens": LONG}, oldest
    statuses = sorted(r.status_code for r in answers)
    assert all(s in (429, 503) for s in statuses), statuses  # none got the slot the oldest held
    assert 503 in statuses and 429 in statuses, statuses  # the 3 queued expire, the rest were turned away
    for r in answers:
        assert int(r.headers["retry-after"]) >= 1
        error = error_body(r)
        if r.status_code == 503:
            assert error["code"] == "overloaded" and "--max-queue-wait" in error["message"], error
        else:
            assert error["code"] == "queue_full" and error["type"] == "rate_limit_error", error
    assert answers[0].headers["content-type"].startswith("application/json")  # the stream's refusal too
    # The server is well afterwards: the slot is free and a new request runs at once.
    after = httpx.post(f"{server.url}/v1/completions", json=body(4), timeout=60)
    assert after.status_code == 200 and after.json()["choices"][0]["finish_reason"] == "length"
