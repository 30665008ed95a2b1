"""Prefill/decode disaggregation end to end: a real `kaon serve --role prefill` and a `--role decode` pointed at
it, behind kaon's router, driven by the official client (docs/disaggregation.md).

The whole request path: client -> router (a real `Router` app on a port, its table holding the decode engine
as the service's one pod, as the operator's watch would) -> decode engine -> prefill engine (K/V back by
NIXL: UCX between the two processes' host memory). The prefill engine also serves /v1 as an ordinary
(aggregated) engine: it is the reference the routed greedy tokens must equal. Both engines load one random
LoRA adapter of the bundled model, so adapter prompts are disaggregated too.

Two engines of the bundled model, started together once for the module (their start-up is most of its
time); the last test kills the prefill engine, so the order of the tests matters (pytest keeps a module's
order)."""
from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from safetensors.torch import save_file

from kaon_operator import api
from kaon_operator.labels import service_labels
from kaon_operator.router import edge
from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.proxy import Router
from support.server import API_KEY, Server

pytestmark = pytest.mark.slow

SERVED = "smollm2"  # the engines' --served-model-name: the `model` clients send through the router
ADAPTER = "terse"
KV_BYTES = str(256 << 20)  # ~5,800 tokens of the bundled model's float32 K/V: ample here; the 1 GiB default's zeroing
# is start-up time each engine pays (the module's time is mostly the two engines' start-up)
MIN_PROMPT = 48  # --disagg-min-prompt-tokens: prompts with fewer uncached tokens stay on the decode engine
LONG = "Kubernetes schedules pods onto nodes; the kubelet starts their containers. " * 8  # ~115 tokens
PROMPTS = [
    LONG,  # chunked on the prefill engine (--max-num-batched-tokens 64), sent whole
    LONG + " Now summarize that in one line.",  # the decode engine holds LONG's blocks: asks for the rest, or not
    "A different long prompt about the sea and its tides, waves and currents. " * 6,
]


def write_adapter(path, seed: int = 7, rank: int = 8) -> None:
    """A random PEFT LoRA adapter of SmolLM2-135M (30 layers, hidden 576, 3 K/V heads of 64) on k_proj and
    v_proj only: it changes nothing but the K/V cache, so K/V a prefill engine computed without it shows."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for proj, fan_out in (("k_proj", 192), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 576, generator=generator) / 24
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * 0.5
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": ["k_proj", "v_proj"], "bias": "none"}))


class RouterThread:
    """kaon's router (the app and listening edge the router Deployment runs) in a thread of this process, its
    endpoint table holding the decode engine as the one ready pod of InferenceService `smollm2` (spec.auth on,
    spec.adapters naming the adapter), as the operator's watch would fill it."""

    def __init__(self, decode_port: int):
        table = EndpointTable(default_namespace="default")
        table.apply_service("ADDED", {
            "apiVersion": api.API_VERSION, "kind": api.KIND,
            "metadata": {"name": SERVED, "namespace": "default", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "spec": {"model": {"uri": "builtin://smollm2-135m-instruct", "servedName": SERVED},
                     "auth": {"apiKeySecret": "keys"}, "adapters": [{"name": ADAPTER, "uri": "pvc://adapters/terse"}]},
            "status": {"auth": {"apiKeySecret": "keys", "keyDigests": [hashlib.sha256(API_KEY.encode()).hexdigest()]}}})
        table.apply_pod("ADDED", {
            "metadata": {"name": f"{SERVED}-decode-0", "namespace": "default", "labels": service_labels(SERVED)},
            "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
            "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": decode_port}]}]}})
        table.synced = True
        self.router = Router(table, RouterConfig(), rng=random.Random(0))
        self.port: int | None = None
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while self.port is None:
            assert self._thread.is_alive() and time.monotonic() < deadline, "the router did not start"
            time.sleep(0.02)
        self.url = f"http://127.0.0.1:{self.port}"

    async def _serve(self) -> None:
        self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
        config = self.router.config
        async with edge.serving(self.router.app(), "127.0.0.1", 0, max_connections=config.max_connections,
                                header_timeout=config.header_timeout) as port:
            self.port = port
            await self._stop.wait()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=30)


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    write_adapter(tmp / ADAPTER)
    ready = {"ready_timeout_s": 300}  # two engines loading at once, on a machine running other tests
    common = ("--api-key", API_KEY, "--served-model-name", SERVED, "--kv-cache-bytes", KV_BYTES,
              "--lora-modules", f"{ADAPTER}={tmp / ADAPTER}")
    # Both load their models at once: the prefill engine's URL is known as soon as its process starts (the
    # decode engine asks it nothing until a request comes).
    prefill = Server.__new__(Server)
    thread = threading.Thread(target=Server.__init__, args=(prefill, tmp, "--role", "prefill", *common,
                                                            "--max-num-batched-tokens", "64"), kwargs=ready)
    thread.start()
    while not hasattr(prefill, "proc"):
        time.sleep(0.05)
    decode = Server(tmp, "--role", "decode", "--prefill-url", prefill.url, *common,
                    "--disagg-min-prompt-tokens", str(MIN_PROMPT), "--disagg-timeout", "20",
                    "--kv-transport", "nixl", **ready)  # UCX on host memory; TCP's frames: the unit tests
    thread.join()
    for role, server in (("prefill", prefill), ("decode", decode)):  # where the set-up time went (--durations)
        phases = [line for line in httpx.get(f"{server.url}/metrics").text.splitlines()
                  if line.startswith("kaon_startup_seconds{")]
        print(role, " ".join(phases))
    router = RouterThread(decode.port)
    yield prefill, decode, router
    router.stop()
    decode.stop()
    prefill.stop()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def metric(server: Server, name: str, label: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f"{name}{{{label}}} "):
            return float(line.split()[1])
    raise KeyError(name)


def received(server: Server) -> float:
    return metric(server, "kaon_kv_transfer_tokens_total", 'direction="received"')


def fallbacks(server: Server) -> float:
    return sum(metric(server, "kaon_kv_transfer_fallbacks_total", f'reason="{r}"')
               for r in ("unreachable", "timeout", "garbage", "refused", "evicted", "busy"))


def sse_events(url: str, path: str, body: dict) -> list[dict]:
    """A streamed answer as the bytes on the wire say it: every `data:` line a JSON chunk, `[DONE]` last."""
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines), lines
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


def test_through_the_router_greedy_tokens_match_the_aggregated_engine_and_the_counters_the_tokens_moved(engines):
    prefill, decode, router = engines
    moved = 0
    for i, prompt in enumerate(PROMPTS):
        reference = client(prefill.url).completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=8)
        if i != 1:
            got = client(router.url).completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=8)
            assert got.object == "text_completion" and got.model == SERVED and got.choices[0].finish_reason
            text, usage = got.choices[0].text, got.usage
        else:  # streamed: OpenAI's chunks on the wire, the usage in the last one
            chunks = sse_events(router.url, "/v1/completions", {
                "model": SERVED, "prompt": prompt, "temperature": 0, "max_tokens": 8,
                "stream_options": {"include_usage": True}})
            assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
            assert chunks[-1]["choices"] == [] and chunks[-2]["choices"][0]["finish_reason"] == "length"
            text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
            usage = openai.types.CompletionUsage.model_validate(chunks[-1]["usage"])
        assert text == reference.choices[0].text, prompt
        uncached = usage.prompt_tokens - 1 - usage.prompt_tokens_details.cached_tokens
        moved += uncached if uncached >= MIN_PROMPT else 0
    assert moved > 2 * MIN_PROMPT  # at least two prompts went through the prefill engine
    assert received(decode) == moved
    assert metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"') == moved
    assert decode.metric("kaon_kv_transfer_seconds_count") >= 2


def test_structured_output_streams_through_the_router_from_received_kv(engines):
    prefill, decode, router = engines
    before = received(decode)
    prompt = "Describe a ship as JSON with the keys name and length. " * 5
    fmt = {"type": "json_schema", "json_schema": {"name": "ship", "schema": {
        "type": "object", "properties": {"name": {"type": "string"}, "length": {"type": "integer"}},
        "required": ["name", "length"]}}}
    messages = [{"role": "user", "content": prompt}]
    reference = client(prefill.url).chat.completions.create(model=SERVED, messages=messages, temperature=0,
                                                             max_tokens=30, response_format=fmt)
    chunks = list(client(router.url).chat.completions.create(
        model=SERVED, messages=messages, temperature=0, max_tokens=30, response_format=fmt, stream=True))
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == reference.choices[0].message.content
    json.loads(streamed)  # the grammar held on the decode engine, which sampled every token
    assert received(decode) > before


def test_a_lora_prompt_is_prefilled_with_its_adapter_on_the_prefill_engine(engines):
    """The adapter is loaded on both engines; the decode engine names it in its ask, so the prefill engine
    computes the prompt's K/V with it (the adapter touches only k_proj and v_proj: base K/V would show)."""
    prefill, decode, router = engines
    prompt = "Write a short note to the team about the release of version two of the operator. " * 4
    base = client(prefill.url).completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=8)
    reference = client(prefill.url).completions.create(model=ADAPTER, prompt=prompt, temperature=0, max_tokens=8)
    assert reference.choices[0].text != base.choices[0].text, "the adapter must change the greedy tokens"
    before, failed = received(decode), fallbacks(decode)
    got = client(router.url).completions.create(model=ADAPTER, prompt=prompt, temperature=0, max_tokens=8)
    assert got.model == ADAPTER and got.choices[0].text == reference.choices[0].text
    assert received(decode) - before == got.usage.prompt_tokens - 1  # all of it moved, computed with the adapter
    assert fallbacks(decode) == failed


def test_a_decode_engine_gone_mid_transfer_frees_the_prefill_engines_blocks(engines):
    prefill, _, _ = engines
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
    prefill, _, _ = engines
    response = httpx.post(f"{prefill.url}/kaon/v1/kv/prefill", json={"token_ids": [1, 2, 3], "start": 2},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert response.status_code == 400 and "start" in response.json()["error"]["message"]
    assert httpx.post(f"{prefill.url}/kaon/v1/kv/prefill", json={"token_ids": [1, 2], "start": 0}).status_code == 401


def test_a_prefill_engine_killed_mid_transfer_costs_no_request_through_the_router(engines):
    """SIGKILL while it streams a prompt's K/V: the routed stream still answers, with the aggregated engine's
    tokens (the decode engine prefills it itself and counts the fallback); the next prompt finds the prefill
    engine down at once (`unreachable`), no wait for --disagg-timeout."""
    prefill, decode, router = engines
    # ~630 tokens: ~10 steps of 64 on the prefill engine, time to see the first ones sent and kill it then.
    prompt = "Explain how a rolling update replaces pods one by one, and why it waits for readiness. " * 35
    after = "A rolling update waits for each new pod to be ready before it stops an old one, and why. " * 5
    # The references on the prefill engine as an aggregated one, under another cache salt: the routed prompt
    # must not find its K/V cached there (then it would move at once, with nothing left to interrupt).
    body = {"temperature": 0, "max_tokens": 6, "extra_body": {"cache_salt": "reference"}}
    reference = client(prefill.url).completions.create(model=SERVED, prompt=prompt, **body)
    reference_after = client(prefill.url).completions.create(model=SERVED, prompt=after, **body)
    sent, failed, moved = metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"'), \
        fallbacks(decode), received(decode)
    answer: dict = {}

    def ask() -> None:
        chunks = client(router.url).completions.create(model=SERVED, prompt=prompt, temperature=0, max_tokens=6,
                                                       stream=True)
        answer["text"] = "".join(c.choices[0].text for c in chunks if c.choices)

    asking = threading.Thread(target=ask)
    asking.start()
    deadline = time.monotonic() + 120
    while metric(prefill, "kaon_kv_transfer_tokens_total", 'direction="sent"') == sent:
        assert time.monotonic() < deadline and asking.is_alive(), "the prefill engine never sent a chunk"
        time.sleep(0.005)
    prefill.stop()  # SIGKILL, mid-transfer
    asking.join(timeout=180)
    assert not asking.is_alive(), "the routed request hangs after its prefill engine died"
    assert answer["text"] == reference.choices[0].text
    assert fallbacks(decode) == failed + 1 and received(decode) == moved  # its K/V did not all arrive: prefilled here
    unreachable = metric(decode, "kaon_kv_transfer_fallbacks_total", 'reason="unreachable"')
    got = client(router.url).completions.create(model=SERVED, prompt=after, temperature=0, max_tokens=6)
    assert got.choices[0].text == reference_after.choices[0].text
    assert metric(decode, "kaon_kv_transfer_fallbacks_total", 'reason="unreachable"') == unreachable + 1
