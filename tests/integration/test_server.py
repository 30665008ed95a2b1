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
    # 64 running slots (a CPU server's default is 8): test_64_concurrent_streams_match_non_streamed runs them
    # all in one batch, so that a chunk sent to the wrong stream would show
    srv = Server(tmp_path_factory.mktemp("serve"), "--api-key", API_KEY, "--max-body-bytes", str(1 << 20),
                 "--max-num-seqs", "64")
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
    # The second run of the same prompt finds it in the prefix cache; the counts are the same.
    details = {"prompt_tokens_details"}
    assert usage.model_dump(exclude=details) == full.usage.model_dump(exclude=details)
    assert usage.prompt_tokens_details.cached_tokens > 0


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


def test_wrong_types_are_400_and_unknown_fields_are_ignored_but_named(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens="five")
    assert "max_tokens" in str(exc.value)
    for bad in ({"presence_penalty": 3}, {"logit_bias": {"abc": 1}}, {"logit_bias": {"5": 101}}, {"min_p": "x"},
                {"logit_bias": {"999999": 1}}, {"stream_options": {"include_usage": True, "frobnicate": 1}}):
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, stream="stream_options" in bad,
                                           extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="suffix"):
        client.completions.create(model=MODEL, prompt="hi", suffix="end")
    # An unknown top-level field (a typo, or another server's extension) is ignored, and named in a header.
    raw = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2,
                                                     extra_body={"frobnicate": True, "top_n": 3})
    assert raw.headers["x-kaon-ignored-fields"] == "frobnicate,top_n"
    assert raw.parse().usage.completion_tokens == 2
    plain = client.completions.with_raw_response.create(model=MODEL, prompt="hi", max_tokens=2, user="u",
                                                       extra_body={"metadata": {"a": "b"}, "service_tier": "auto"})
    assert "x-kaon-ignored-fields" not in plain.headers


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


def _poll(condition, timeout_s: float = 60) -> bool:  # a deadline only fails a broken build
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
                assert _poll(lambda: http.get(f"{srv.url}/ready").status_code == 503, 30)
                refused = http.post(url, json=body)
                assert refused.status_code == 503 and error_body(refused)["code"] == "draining"
                rest = [line for line in lines if line]
            events = [json.loads(line.removeprefix("data: ")) for line in [first, *rest[:-1]]]
            assert rest[-1] == "data: [DONE]" and events[-1]["choices"][0]["finish_reason"] == "length"
            assert queued.result().json()["usage"]["completion_tokens"] == 5
        assert srv.proc.wait(timeout=30) == 0
    finally:
        srv.stop()


# ---- vLLM's request extensions --------------------------------------------------------------


def test_penalties_and_vllm_fields_change_the_output(client):
    # A prompt the model goes on repeating: penalties on the output, or on the prompt too, change it.
    rep = dict(model=MODEL, prompt="The quick brown fox. " * 6, temperature=0, max_tokens=12)
    plain = client.completions.create(**rep).choices[0].text
    assert plain.count("fox") >= 2
    for extension in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}, {"repetition_penalty": 3.0}):
        assert client.completions.create(**rep, extra_body=extension).choices[0].text != plain, extension
    base = dict(model=MODEL, messages=CHAT, temperature=0, max_tokens=12)
    vllm = client.chat.completions.create(**base, extra_body={
        "repetition_penalty": 1.5, "min_p": 0.1, "min_tokens": 12, "ignore_eos": True, "stop_token_ids": [0],
        "skip_special_tokens": True, "spaces_between_special_tokens": True, "include_stop_str_in_output": False})
    assert vllm.usage.completion_tokens == 12


def test_logit_bias_forces_a_token(client):
    out = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3, logprobs=0,
                                    logit_bias={"42": 100})
    assert out.choices[0].logprobs.tokens == [out.choices[0].logprobs.tokens[0]] * 3
    again = client.completions.create(model=MODEL, prompt="Hi there", temperature=0, max_tokens=1, logprobs=0,
                                      logit_bias={"42": 100})
    assert again.choices[0].logprobs.tokens == out.choices[0].logprobs.tokens[:1]


def test_stop_string_kept_with_include_stop_str_in_output(client):
    full = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=30)
    text = full.choices[0].message.content
    stop = text.split()[4]
    kept = client.chat.completions.create(model=MODEL, messages=CHAT, temperature=0, max_tokens=30, stop=[stop],
                                          extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].message.content == text[:text.index(stop) + len(stop)]


def test_continuous_usage_stats_and_cached_tokens(client):
    chunks = list(client.completions.create(
        model=MODEL, prompt="The quick brown fox " * 20, temperature=0, max_tokens=5, stream=True,
        stream_options={"include_usage": True}, extra_body={"stream_options": {
            "include_usage": True, "continuous_usage_stats": True}}))
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in with_text)
    assert [c.usage.completion_tokens for c in with_text] == sorted(c.usage.completion_tokens for c in with_text)
    assert chunks[-1].usage.completion_tokens == 5
    # The same long prompt again: its leading blocks come from the prefix cache.
    again = client.completions.create(model=MODEL, prompt="The quick brown fox " * 20, temperature=0, max_tokens=1)
    details = again.usage.prompt_tokens_details
    assert details is not None and 0 < details.cached_tokens < again.usage.prompt_tokens


def test_echo_logprobs_and_max_tokens_0_score_the_prompt(client):
    """What lm-evaluation-harness's loglikelihood tasks send (local-completions)."""
    prompt = "The capital of France is Paris"
    scored = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=0)
    choice = scored.choices[0]
    assert choice.text == prompt and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == scored.usage.prompt_tokens
    assert all(x < 0 for x in lp.token_logprobs[1:])
    # OpenAI's legacy top_logprobs hold the k most likely and the token itself ("up to logprobs+1
    # elements"), as vLLM sends them: harnesses look the token up there.
    for token, logprob, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert 2 <= len(top) <= 3 and top[token] == logprob
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    # The same prompt plus one generated token: the prompt part is unchanged, then the new token.
    more = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1,
                                     temperature=0).choices[0]
    assert more.text.startswith(prompt) and len(more.logprobs.tokens) == len(lp.tokens) + 1
    assert all(abs(a - b) < 1e-4 for a, b in zip(more.logprobs.token_logprobs[1:], lp.token_logprobs[1:]))
    assert more.logprobs.text_offset[-1] == len(prompt)
    # vLLM's prompt_logprobs: the same numbers, keyed by token id.
    raw = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1,
                                    extra_body={"prompt_logprobs": 1}).model_dump()["choices"][0]["prompt_logprobs"]
    assert raw[0] is None and len(raw) == len(lp.tokens)
    assert [max(e.values(), key=lambda v: v["logprob"])["logprob"] for e in raw[1:]] == pytest.approx(
        [max(t.values()) for t in lp.top_logprobs[1:]], abs=1e-4)
    # logprobs 0: no alternatives, but the token itself, echoed and generated (sampled: not the greedy one).
    bare = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=0, max_tokens=3,
                                     temperature=1.5, seed=5).choices[0].logprobs
    assert bare.top_logprobs[0] is None and len(bare.tokens) == len(lp.tokens) + 3
    assert bare.top_logprobs[1:] == [{t: x} for t, x in zip(bare.tokens[1:], bare.token_logprobs[1:])]
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=0)


def test_tokenize_detokenize_and_models_max_model_len(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    out = httpx.post(f"{server.url}/tokenize", headers=headers,
                     json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True}).json()
    assert out["count"] == len(out["tokens"]) == len(out["token_strs"]) and out["max_model_len"] == 8192
    back = httpx.post(f"{server.url}/detokenize", headers=headers, json={"tokens": out["tokens"]}).json()
    assert back["prompt"].endswith("Hello world")
    # Messages count as the chat endpoint counts them.
    chat = httpx.post(f"{server.url}/tokenize", headers=headers, json={"messages": CHAT}).json()
    used = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1).usage.prompt_tokens
    assert chat["count"] == used
    assert httpx.post(f"{server.url}/tokenize", json={"prompt": "hi"}).status_code == 401
    for path, body in [("/tokenize", {"prompt": "a", "messages": CHAT}), ("/tokenize", {"prompt": 5}),
                       ("/detokenize", {"tokens": [10 ** 9]}), ("/detokenize", {"tokens": ["a"]})]:
        response = httpx.post(f"{server.url}{path}", headers=headers, json=body)
        assert response.status_code == 400 and response.json()["error"]["message"], (path, body)
    assert client.models.list().data[0].model_dump()["max_model_len"] == 8192


def test_responses_api_subset(client):
    out = client.responses.create(model=MODEL, input="Say hello.", instructions="Be brief.", max_output_tokens=8,
                                  temperature=0)
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.output_text and out.usage.output_tokens == 8
    same = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hello."}])
    assert out.output_text == same.choices[0].message.content
    events = list(client.responses.create(model=MODEL, input=[{"role": "user", "content": "Say hello."}],
                                          instructions="Be brief.", max_output_tokens=8, temperature=0,
                                          stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == out.output_text
    for stateful in ({"previous_response_id": "resp_1"}, {"store": True}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input="hi", **stateful)


def test_return_tokens_as_token_ids(client):
    out = client.completions.create(model=MODEL, prompt="Hello", temperature=0, max_tokens=3, logprobs=1, echo=True,
                                    extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert all(t.startswith("token_id:") and t[9:].isdigit() for t in out.tokens)
    assert all(k.startswith("token_id:") for top in out.top_logprobs[1:] for k in top)
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, logprobs=True,
                                          extra_body={"return_tokens_as_token_ids": True})
    assert all(c.token.startswith("token_id:") for c in chat.choices[0].logprobs.content)


def test_responses_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"],
              "additionalProperties": False}
    out = client.responses.create(model=MODEL, input="What is two plus two? Answer in JSON.", temperature=0,
                                  max_output_tokens=40, text={"format": {"type": "json_schema", "name": "sum",
                                                                         "schema": schema, "strict": True}})
    assert set(json.loads(out.output_text)) == {"answer"}


def test_a_batch_of_prompts_answers_as_each_prompt_alone_streamed_and_echoed_too(client):
    """`prompt` as a list (OpenAI's and vLLM's batch) was a 400; echo with stream was a 400."""
    prompts = ["The capital of France is", "One plus one is", "Robots paint"]
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 6, "logprobs": 1, "echo": True}
    replies = [client.completions.create(prompt=prompt, **greedy) for prompt in prompts]
    alone = [reply.choices[0] for reply in replies]
    batch = client.completions.create(prompt=prompts, n=2, **greedy)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, one in enumerate(alone):
        for choice in batch.choices[2 * i:2 * i + 2]:
            assert choice.text == one.text and choice.text.startswith(prompts[i])
            assert choice.logprobs.tokens == one.logprobs.tokens
    assert batch.usage.prompt_tokens == sum(reply.usage.prompt_tokens for reply in replies)
    streamed: dict[int, str] = {}
    for chunk in client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True},
                                           **greedy):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        usage = chunk.usage
    assert streamed == {i: one.text for i, one in enumerate(alone)}
    assert usage.completion_tokens == sum(reply.usage.completion_tokens for reply in replies)
    assert usage.prompt_tokens == batch.usage.prompt_tokens


def test_vllms_guided_json_constrains_a_completion(client):
    """guided_json was an unknown field, ignored: the model wrote free text."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    out = client.completions.create(model=MODEL, prompt="A person:", max_tokens=60, temperature=0,
                                    extra_body={"guided_json": schema})
    assert out.choices[0].finish_reason == "stop" and set(json.loads(out.choices[0].text)) == {"name", "age"}
    choice = client.completions.create(model=MODEL, prompt="Yes or no?", max_tokens=5,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")


def test_the_openai_clients_responses_stream_helper_builds_the_response(client):
    """responses.stream() raised "Received a content event for output index 0 before receiving its output item"."""
    with client.responses.stream(model=MODEL, input="Say hello.", max_output_tokens=8, temperature=0) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas and deltas
