"""The OpenAI-compatible server, end to end: a real `kaon serve` process driven by the official client."""
from __future__ import annotations

import asyncio
import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from support.server import API_KEY, MODEL, Server, error_body

CHAT = [{"role": "user", "content": "Tell me a short story about a robot who learns to paint."}]


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-key", API_KEY, "--max-body-bytes", str(1 << 20))
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="session")
def aclient(server):
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _stream_chat(client, **kwargs) -> tuple[str, str | None, object]:
    text, finish, usage = "", None, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kwargs):
        usage = chunk.usage or usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish, usage


# ---- the happy path -----------------------------------------------------------------------


def test_models_health_ready(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/ready").status_code == 200


def test_chat_streamed_equals_non_streamed_with_usage(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=20)
    choice = full.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert full.usage.completion_tokens == 20
    assert full.usage.total_tokens == full.usage.prompt_tokens + 20
    text, finish, usage = _stream_chat(client, messages=CHAT, temperature=0, max_tokens=20,
                                       stream_options={"include_usage": True})
    assert text == choice.message.content and finish == "length"
    assert usage.model_dump() == full.usage.model_dump()


def test_completions_streamed_equals_non_streamed(client):
    full = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                     max_tokens=12, logprobs=2)
    choice = full.choices[0]
    assert full.usage.completion_tokens == len(choice.logprobs.tokens) == 12
    assert "".join(choice.logprobs.tokens) == choice.text
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs)
    chunks = list(client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0,
                                            max_tokens=12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == choice.text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_stop_sequence_cuts_streamed_and_non_streamed(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=30)
    text = full.choices[0].message.content
    stop = text.split()[4]  # a word from the middle, likely spanning tokens with its neighbours
    cut = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=30, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == text[:text.index(stop)]
    streamed, finish, _ = _stream_chat(client, messages=CHAT, temperature=0, max_tokens=30, stop=stop)
    assert (streamed, finish) == (text[:text.index(stop)], "stop")


def test_n_choices_and_seed(client):
    kwargs = dict(model=MODEL, messages=CHAT, temperature=1.0, max_tokens=8, n=3, seed=7)
    first = client.chat.completions.create(**kwargs)
    assert sorted(c.index for c in first.choices) == [0, 1, 2]
    assert 3 <= first.usage.completion_tokens <= 3 * 8
    again = client.chat.completions.create(**kwargs)
    assert [c.message.content for c in again.choices] == [c.message.content for c in first.choices]
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + (c.delta.content or "")
    assert [streamed[i] for i in range(3)] == [c.message.content for c in first.choices]


# ---- errors -------------------------------------------------------------------------------


def test_wrong_types_and_unknown_fields_are_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens="five")
    assert "max_tokens" in str(exc.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="hi", extra_body={"frobnicate": True})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=CHAT, presence_penalty=0.5)


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-nope", messages=CHAT)
    assert exc.value.body["code"] == "model_not_found"


def test_too_long_is_400_with_the_numbers(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=100_000)
    assert "100000" in str(exc.value) and "8192" in str(exc.value)


def test_api_key_is_required(server):
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 1}
    missing = httpx.post(f"{server.url}/v1/completions", json=body)
    assert missing.status_code == 401 and error_body(missing)["code"] == "invalid_api_key"
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


def test_malformed_json_is_400_and_oversized_body_is_413(server):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    bad = httpx.post(f"{server.url}/v1/chat/completions", content=b'{"model": ', headers=headers)
    assert bad.status_code == 400 and "JSON" in error_body(bad)["message"]
    huge = httpx.post(f"{server.url}/v1/completions", headers=headers,
                      content=json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}))
    assert huge.status_code == 413


# ---- concurrency, disconnects, drain --------------------------------------------------------


NUM_CONCURRENT = 64


def test_64_concurrent_streams_match_non_streamed(aclient):
    prompts = [[{"role": "user", "content": f"Write the number {i} in words, then name a colour."}]
               for i in range(NUM_CONCURRENT)]

    async def whole(messages):
        response = await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                         max_tokens=8)
        return response.choices[0].message.content

    async def streamed(messages):
        text, ids = "", set()
        async for chunk in await aclient.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                                 max_tokens=8, stream=True):
            ids.add(chunk.id)
            text += "".join(c.delta.content or "" for c in chunk.choices)
        return text, ids

    async def both():
        expected = await asyncio.gather(*(whole(m) for m in prompts))
        got = await asyncio.gather(*(streamed(m) for m in prompts))  # all 64 open at once
        return expected, got

    expected, got = asyncio.run(both())
    assert len(set(expected)) > NUM_CONCURRENT // 2  # distinct prompts, so interleaving would show
    assert [text for text, _ in got] == expected
    ids = [stream_ids for _, stream_ids in got]
    assert all(len(stream_ids) == 1 for stream_ids in ids)  # each stream carries only its own chunks
    assert len(set().union(*ids)) == NUM_CONCURRENT


def _poll(condition, timeout_s: float = 15) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def test_client_disconnect_frees_the_kv_cache(server):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as response:
            lines = response.iter_lines()
            for _ in range(3):
                assert next(lines).startswith("data: ") and next(lines) == ""
            assert server.metric("kaon_kv_cache_usage_ratio") > 0
    assert _poll(lambda: server.metric("kaon_kv_cache_usage_ratio") == 0)
    assert server.metric("kaon_num_requests_running") == 0


def test_full_queue_is_429_and_sigterm_drains_running_and_queued(tmp_path):
    # One sequence at a time and one waiting: a running stream plus a queued request fill it.
    srv = Server(tmp_path, "--max-num-seqs", "1", "--max-queue", "1", "--drain-timeout", "60")
    url = f"{srv.url}/v1/completions"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True}
    try:
        with httpx.Client(timeout=60) as http, ThreadPoolExecutor(1) as pool:
            with http.stream("POST", url, json={**body, "stream": True}) as response:
                lines = response.iter_lines()
                first = next(lines)
                queued = pool.submit(httpx.post, url, json={**body, "max_tokens": 5}, timeout=60)
                assert _poll(lambda: srv.metric("kaon_num_requests_waiting") == 1)
                full = http.post(url, json=body)
                assert full.status_code == 429 and error_body(full)["code"] == "queue_full"
                assert full.headers["retry-after"] == "1"

                srv.proc.send_signal(signal.SIGTERM)
                assert _poll(lambda: http.get(f"{srv.url}/ready").status_code == 503, 5)
                refused = http.post(url, json=body)
                assert refused.status_code == 503 and error_body(refused)["code"] == "draining"
                rest = [line for line in lines if line]
            events = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
            assert rest[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
            assert queued.result().json()["usage"]["completion_tokens"] == 5
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()
