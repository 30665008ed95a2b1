"""Prefill/decode disaggregation end to end: a real `kaon serve --role prefill` and a `--role decode` pointed at
it, driven by the official client (docs/disaggregation.md).

The prefill engine also serves /v1 as an ordinary (aggregated) engine: it is the reference the decode
engine's greedy tokens must equal. The K/V moves by NIXL (UCX between the two processes' host memory).
Two engines of the bundled model, started together; the last test
kills the prefill engine, so the order of the tests matters (pytest keeps a module's order)."""
from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from support.server import API_KEY, MODEL, Server

pytestmark = pytest.mark.slow

KV_BYTES = str(256 << 20)  # ~5,800 tokens of the bundled model's float32 K/V: ample here; the 1 GiB default's zeroing
# is start-up time each engine pays (the module's time is mostly the two engines' start-up)
MIN_PROMPT = 48  # --disagg-min-prompt-tokens: prompts with fewer uncached tokens stay on the decode engine
LONG = "Kubernetes schedules pods onto nodes; the kubelet starts their containers. " * 8  # ~115 tokens
PROMPTS = [
    LONG,  # chunked on the prefill engine (--max-num-batched-tokens 64), sent whole
    LONG + " Now summarize that in one line.",  # the decode engine holds LONG's blocks: asks for the rest, or not
    "A different long prompt about the sea and its tides, waves and currents. " * 6,
]


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    # Both load their models at once: the prefill engine's URL is known as soon as its process starts (the
    # decode engine asks it nothing until a request comes).
    prefill = Server.__new__(Server)
    thread = threading.Thread(target=Server.__init__, args=(prefill, tmp, "--role", "prefill", "--api-key", API_KEY,
                                                            "--max-num-batched-tokens", "64",
                                                            "--kv-cache-bytes", KV_BYTES))
    thread.start()
    while not hasattr(prefill, "proc"):
        time.sleep(0.05)
    decode = Server(tmp, "--role", "decode", "--prefill-url", prefill.url, "--api-key", API_KEY,
                    "--disagg-min-prompt-tokens", str(MIN_PROMPT), "--disagg-timeout", "20",
                    "--kv-cache-bytes", KV_BYTES,
                    "--kv-transport", "nixl")  # UCX on host memory; TCP's frames: the unit tests and the test below
    thread.join()
    for role, server in (("prefill", prefill), ("decode", decode)):  # where the set-up time went (--durations)
        phases = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                  if line.startswith("kaon_startup_seconds{")]
        print(role, " ".join(phases))
    yield prefill, decode
    decode.stop()
    prefill.stop()


def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric(server: Server, name: str, label: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[1])
    raise KeyError(name)


def test_decode_engine_matches_the_aggregated_engine_and_counts_the_tokens_it_received(engines):
    prefill, decode = engines
    moved = 0
    for prompt in PROMPTS:
        reference = client(prefill).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
        got = client(decode).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
        assert got.choices[0].text == reference.choices[0].text, prompt
        uncached = got.usage.prompt_tokens - 1 - got.usage.prompt_tokens_details.cached_tokens
        moved += uncached if uncached >= MIN_PROMPT else 0
    assert moved > 2 * MIN_PROMPT  # at least two prompts went through the prefill engine
    assert metric(decode, "kaon_kv_transfer_tokens_total", 'direction="received"') == moved
    assert metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"') == moved
    assert decode.metric("kaon_kv_transfer_seconds_count") >= 2


def test_structured_output_and_streams_are_decoded_from_received_kv(engines):
    prefill, decode = engines
    before = metric(decode, "kaon_kv_transfer_tokens_total", 'direction="received"')
    prompt = "Describe a ship as JSON with the keys name and length. " * 5
    fmt = {"type": "json_schema", "json_schema": {"name": "ship", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "length": {"type": "integer"}},
        "required": ["name", "length"]}}}
    messages = [{"role": "user", "content": prompt}]
    reference = client(prefill).chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                         max_tokens=30, response_format=fmt)
    streamed = "".join(c.choices[0].delta.content or "" for c in client(decode).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=30, response_format=fmt, stream=True)
        if c.choices)
    assert streamed == reference.choices[0].message.content
    json.loads(streamed)  # the grammar held on the decode engine, which sampled every token
    assert metric(decode, "kaon_kv_transfer_tokens_total", 'direction="received"') > before


def test_a_decode_engine_gone_mid_transfer_frees_the_prefill_engines_blocks(engines):
    prefill, _ = engines
    token_ids = list(range(1000, 1700))  # 700 tokens: 11 steps of 64 on the prefill engine
    sent_before = metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"')
    with httpx.stream("POST", f"{prefill.url}/kaon/v1/kv/prefill", json={"token_ids": token_ids, "start": 0},
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_bytes())  # the first frames, then the "decode engine" is gone
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (prefill.metric("kaon_num_requests_running") or
                                           prefill.metric("kaon_kv_cache_usage_ratio") or
                                           prefill.metric("kaon_num_prompt_tokens_waiting")):
        time.sleep(0.1)
    assert prefill.metric("kaon_num_requests_running") == 0 and prefill.metric("kaon_kv_cache_usage_ratio") == 0
    assert prefill.metric("kaon_num_prompt_tokens_waiting") == 0  # not left queued either (the prefill pool's signal)
    assert metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"') - sent_before < len(token_ids) - 1


def test_a_bad_ask_is_a_clear_error(engines):
    prefill, _ = engines
    response = httpx.post(f"{prefill.url}/kaon/v1/kv/prefill", json={"token_ids": [1, 2, 3], "start": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "start" in response.json()["error"]["message"]
    assert httpx.post(f"{prefill.url}/kaon/v1/kv/prefill", json={"token_ids": [1, 2], "start": 0}).status_code == 401


def test_a_killed_prefill_engine_costs_no_request(engines):
    prefill, decode = engines
    prompt = "Explain how a rolling update replaces pods one by one, and why. " * 6
    reference = client(prefill).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10)
    prefill.stop()
    got = client(decode).completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=10)
    assert got.choices[0].text == reference.choices[0].text
    assert metric(decode, "kaon_kv_transfer_fallbacks_total", 'reason="unreachable"') == 1
