"""What the vLLM ecosystem's clients send beyond chat and completions, through a real `kaon serve`
with the official openai client: prompt_logprobs on chat and its cost cap, /v1/responses' function
tools, and /v1/embeddings (a server started with --task embed)."""
from __future__ import annotations

import httpx
import openai
import pytest

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
