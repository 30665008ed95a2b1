"""The vLLM ecosystem's request fields and endpoints go through kaon-router to a real `kaon serve`
unchanged: the same body sent to the engine directly and through the router gets the same answer
(ids and clocks aside), and the answer shows each field took effect."""
from __future__ import annotations

import asyncio
import math

import httpx
import pytest

from support.embed_model import EMBED_MODEL
from support.router import routed, serving
from support.server import MODEL, Server

PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
VOLATILE = {"id", "created", "created_at", "call_id", "cached_tokens"}  # what differs between two answers (the
# second finds the first one's prompt in the prefix cache)


@pytest.fixture
def generating(default_server):
    return default_server  # the session's one (tests/conftest.py), shared with test_serve_cost_bounds


@pytest.fixture
def embedding(embed_server):
    return embed_server[0]  # the session's one (tests/conftest.py), shared with test_ecosystem_server


def same(a, b) -> bool:
    """Equal but for VOLATILE keys; floats to 1e-4 (a prefix-cache hit may round differently)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = set(a) - VOLATILE
        return keys == set(b) - VOLATILE and all(same(a[k], b[k]) for k in keys)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return math.isclose(a, b, abs_tol=1e-4)
    return a == b


def through_router(server: Server, served_name: str, path: str, body: dict) -> dict:
    class Engine:  # the real server, as the router's pod table sees it
        name, port = "kaon-0", int(server.url.rsplit(":", 1)[1])

    async def post():
        async with serving(routed(Engine(), served_name=served_name)) as session:
            async with session.post(path, json=body) as response:
                assert response.status == 200, await response.text()
                return await response.json()

    return asyncio.run(asyncio.wait_for(post(), 120))


def both(server: Server, served_name: str, path: str, body: dict) -> dict:
    direct = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert direct.status_code == 200, direct.text
    via_router = through_router(server, served_name, path, body)
    assert same(via_router, direct.json()), (via_router, direct.json())
    return via_router


def test_vllm_request_fields_pass_through_the_router(generating):
    plain = both(generating, MODEL, "/v1/completions", {"model": MODEL, "prompt": PROMPT, "max_tokens": 4,
                                                        "temperature": 0, "logprobs": 1,
                                                        "return_tokens_as_token_ids": True})
    first = int(plain["choices"][0]["logprobs"]["tokens"][0].removeprefix("token_id:"))
    out = both(generating, MODEL, "/v1/completions", {
        "model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "echo": True, "logprobs": 1,
        "prompt_logprobs": 1, "ignore_eos": True, "min_tokens": 6, "logit_bias": {str(first): -100},
        "repetition_penalty": 1.3, "stop_token_ids": [first], "return_tokens_as_token_ids": True})
    choice = out["choices"][0]
    assert choice["text"].startswith(PROMPT)  # echo
    assert choice["prompt_logprobs"][0] is None and len(choice["prompt_logprobs"]) == out["usage"]["prompt_tokens"]
    generated = choice["logprobs"]["tokens"][out["usage"]["prompt_tokens"]:]
    assert out["usage"]["completion_tokens"] == 6 and len(generated) == 6  # min_tokens, ignore_eos
    assert all(t.startswith("token_id:") for t in generated)  # return_tokens_as_token_ids
    assert f"token_id:{first}" not in generated  # logit_bias -100 (and stop_token_ids never met)
    chat = both(generating, MODEL, "/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3,
                                                             "temperature": 0, "prompt_logprobs": 0})
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_responses_and_embeddings_pass_through_the_router(generating, embedding):
    out = both(generating, MODEL, "/v1/responses", {"model": MODEL, "input": "Say hello.", "max_output_tokens": 5,
                                                    "temperature": 0})
    assert out["object"] == "response" and out["output"][0]["content"][0]["text"]
    vectors = both(embedding, EMBED_MODEL, "/v1/embeddings", {"model": EMBED_MODEL, "input": ["a cat", "a dog"],
                                                              "encoding_format": "float"})
    assert [d["index"] for d in vectors["data"]] == [0, 1] and len(vectors["data"][0]["embedding"]) == 64
    encoded = both(embedding, EMBED_MODEL, "/v1/embeddings", {"model": EMBED_MODEL, "input": "a cat",
                                                              "encoding_format": "base64"})
    assert isinstance(encoded["data"][0]["embedding"], str)
