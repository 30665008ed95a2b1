"""What the vLLM ecosystem's clients send beyond chat and completions, through a real `kaon serve`
with the official openai client: prompt_logprobs on chat and its cost cap, /v1/responses' function
tools, and /v1/embeddings (a server started with --task embed)."""
from __future__ import annotations

import httpx
import openai
import pytest

from support.embed_model import EMBED_MODEL
from support.server import MODEL, Server

CHAT = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("serve"), "--max-logprob-entries", "3000")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)


# ---- prompt_logprobs on chat ----------------------------------------------------------------


def test_chat_prompt_logprobs_score_the_rendered_prompt_as_completions_do(server, client):
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 2}).model_dump()
    scored = chat["prompt_logprobs"]
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert len(scored) == len(ids) == chat["usage"]["prompt_tokens"] and scored[0] is None
    for token_id, entry in zip(ids[1:], scored[1:]):
        assert str(token_id) in entry and 2 <= len(entry) <= 3  # the token itself and the top 2
    # The same token ids as a completion prompt: the same numbers.
    plain = client.completions.create(model=MODEL, prompt=ids, max_tokens=1,
                                      extra_body={"prompt_logprobs": 2}).model_dump()["choices"][0]
    for a, b in zip(scored[1:], plain["prompt_logprobs"][1:]):
        assert a.keys() == b.keys()
        assert all(abs(a[k]["logprob"] - b[k]["logprob"]) < 1e-4 for k in a)
    # Not asked for: not in the response at all.
    assert "prompt_logprobs" not in client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=1).model_dump(exclude_unset=True)


def test_a_long_prompt_scored_with_many_alternatives_is_a_400_naming_the_flag(client):
    long_prompt = "one two three four five six seven eight nine ten " * 20  # about 200 tokens, x 21 > 3000
    with pytest.raises(openai.BadRequestError, match="--max-logprob-entries"):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=0, extra_body={"prompt_logprobs": 20})
    with pytest.raises(openai.BadRequestError, match="--max-logprob-entries"):
        client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=0, echo=True, logprobs=5,
                                  extra_body={"prompt_logprobs": 20})
    with pytest.raises(openai.BadRequestError, match="--max-logprob-entries"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_prompt}],
                                       max_tokens=1, extra_body={"prompt_logprobs": 20})
    # The same prompt with fewer alternatives fits: (0 + 1) x ~200.
    ok = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=0, extra_body={"prompt_logprobs": 0})
    assert ok.usage.prompt_tokens > 150


# ---- /v1/responses: function tools ---------------------------------------------------------

WEATHER_TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
                "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                               "required": ["city"], "additionalProperties": False}, "strict": True}
ASK = "What is the weather like in Paris right now?"


def test_responses_tools_make_function_calls_and_read_their_outputs(client):
    import json
    out = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                  parallel_tool_calls=False, temperature=0, max_output_tokens=60)
    calls = [item for item in out.output if item.type == "function_call"]
    assert calls and out.status == "completed"
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city"}
    # A named function forces that one.
    named = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER_TOOL], temperature=0, max_output_tokens=60,
                                    tool_choice={"type": "function", "name": "get_weather"})
    assert [i.name for i in named.output if i.type == "function_call"] == ["get_weather"]
    # The call and its output fed back: the model answers in text, and the prompt holds both.
    follow = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature_c": 21}'}]
    answer = client.responses.create(model=MODEL, input=follow, tools=[WEATHER_TOOL], tool_choice="none",
                                     temperature=0, max_output_tokens=20)
    assert answer.output[0].type == "message" and answer.output_text
    with_result = answer.usage.input_tokens
    without = client.responses.create(model=MODEL, input=follow[:1], tools=[WEATHER_TOOL], tool_choice="none",
                                      temperature=0, max_output_tokens=1).usage.input_tokens
    assert with_result > without + 5  # the call and its result reached the prompt
    # The same as a chat completion with tool_calls and a tool message: the same text.
    chat = client.chat.completions.create(model=MODEL, temperature=0, max_tokens=20, tool_choice="none", tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}], messages=[
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temperature_c": 21}'}])
    assert chat.choices[0].message.content == answer.output_text


def test_responses_tools_stream_the_call_as_items(client):
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                          temperature=0, max_output_tokens=60, stream=True))
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.output_item.added" in kinds and "response.function_call_arguments.done" in kinds
    done = next(e for e in events if e.type == "response.output_item.done").item
    final = [i for i in events[-1].response.output if i.type == "function_call"]
    assert done.type == "function_call" and final[0].call_id == done.call_id and final[0].arguments == done.arguments
    # Bad tools are 400s.
    for bad in ({"tool_choice": "required"}, {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                                                                     "name": "nope"}},
                {"tools": [{"type": "function"}]}):
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=MODEL, input=ASK, **bad)


# ---- /v1/embeddings ------------------------------------------------------------------------

# The embedding server is the session's (support/embed_model.py), shared with test_router_ecosystem.


def test_embeddings_equal_transformers_in_every_input_and_encoding(embed_server):
    import torch
    import torch.nn.functional as F

    from support.embed_model import reference_embedding
    server, hf = embed_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    texts = ["The quick brown fox jumps over the lazy dog.", "Embeddings, please", "x"]
    ids = [httpx.post(f"{server.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    expected = [reference_embedding(hf, i) for i in ids]

    def check(vectors):
        assert len(vectors) == len(expected)
        for got, want in zip(vectors, expected):
            got = torch.tensor(got, dtype=torch.float32)
            assert got.shape == (64,) and F.cosine_similarity(got, want, dim=0) >= 0.9999
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)

    # The openai client asks for base64 unless told otherwise, and decodes it.
    batch = client.embeddings.create(model=EMBED_MODEL, input=texts)
    assert [d.index for d in batch.data] == [0, 1, 2] and batch.object == "list" and batch.model == EMBED_MODEL
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(map(len, ids))
    check([d.embedding for d in batch.data])
    check([d.embedding for d in client.embeddings.create(model=EMBED_MODEL, input=texts,
                                                         encoding_format="float").data])
    check([client.embeddings.create(model=EMBED_MODEL, input=i, dimensions=64).data[0].embedding for i in ids])
    check([d.embedding for d in client.embeddings.create(model=EMBED_MODEL, input=ids).data])
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBED_MODEL, "input": texts[0],
                                                          "encoding_format": "float"}).json()
    assert isinstance(raw["data"][0]["embedding"][0], float) and raw["data"][0]["object"] == "embedding"
    # vLLM's normalize: false gives the pooled vector itself.
    plain = httpx.post(f"{server.url}/v1/embeddings", json={"model": EMBED_MODEL, "input": texts[0],
                                                            "encoding_format": "float", "normalize": False}).json()
    assert abs(torch.tensor(plain["data"][0]["embedding"]).norm().item() - 1) > 1e-3


def test_an_embedding_input_past_the_context_is_a_400_unless_the_request_asks_for_the_cut(embed_server):
    """As vLLM answers it: an input past the context is refused in vLLM's words (its token count, the maximum),
    strings and token ids alike; vLLM's truncate_prompt_tokens embeds its first k tokens (-1: the context's
    worth), where the field used to be ignored. An input of exactly the context is embedded (no token is left
    to generate, and none needs to be)."""
    import torch
    import torch.nn.functional as F

    from support.embed_model import reference_embedding
    server, hf = embed_server
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    context = client.models.list().data[0].max_model_len
    ids = [(7 * i) % 200 + 10 for i in range(context + 8)]
    text = "embeddings please " * context
    for long_input, count in [(ids, context + 8), ([[5, 6], ids], context + 8)]:
        with pytest.raises(openai.BadRequestError, match=f"maximum context length is {context} tokens. However, "
                                                          f"you requested {count} tokens in the input"):
            client.embeddings.create(model=EMBED_MODEL, input=long_input)
    with pytest.raises(openai.BadRequestError, match=f"maximum context length is {context} tokens") as refused:
        client.embeddings.create(model=EMBED_MODEL, input=text)
    assert refused.value.body["code"] == "context_length_exceeded"
    for keep, expected in [(-1, ids[:context]), (8, ids[:8])]:
        got = client.embeddings.create(model=EMBED_MODEL, input=ids, extra_body={"truncate_prompt_tokens": keep})
        assert got.usage.prompt_tokens == len(expected)
        vector = torch.tensor(got.data[0].embedding, dtype=torch.float32)
        assert F.cosine_similarity(vector, reference_embedding(hf, expected), dim=0) >= 0.9999
    cut = client.embeddings.create(model=EMBED_MODEL, input=text, extra_body={"truncate_prompt_tokens": 16})
    assert cut.usage.prompt_tokens == 16
    with pytest.raises(openai.BadRequestError, match="greater than max_model_len") as refused:
        client.embeddings.create(model=EMBED_MODEL, input="a", extra_body={"truncate_prompt_tokens": context + 1})
    assert refused.value.body["param"] == "truncate_prompt_tokens"


def test_bad_embedding_requests_are_400s_and_tasks_do_not_mix(embed_server, server, client):
    srv, _ = embed_server
    embed_client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0, timeout=60)
    for bad, match in [(dict(input=""), "empty"), (dict(input=[]), "input"), (dict(input=["a", ""]), "empty"),
                       (dict(input=[[1, 2], []]), "empty"), (dict(input=[10 ** 7]), "token ids"),
                       (dict(input="a", dimensions=32), "dimensions"), (dict(input="a", encoding_format="int8"),
                                                                        "encoding_format"),
                       (dict(input=5), "input")]:
        with pytest.raises(openai.BadRequestError, match=match):
            embed_client.embeddings.create(model=EMBED_MODEL, **bad)
    with pytest.raises(openai.NotFoundError):
        embed_client.embeddings.create(model="other", input="a")
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        embed_client.chat.completions.create(model=EMBED_MODEL, messages=CHAT, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        client.embeddings.create(model=MODEL, input="a")  # the generating server
