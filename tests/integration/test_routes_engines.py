"""InferenceRoute through the real router to two real `kaon serve` processes of the bundled model (the
tiers `small` and `large`; on this machine both run SmolLM2, so this checks the mechanism, not a
quality gap), driven by the official OpenAI client: the tier the classifier picks for labelled
prompts, a cache hit identical to the original answer (streamed too) that costs the engines no token,
and no hit for another API key."""
from __future__ import annotations

import asyncio
import random
import threading

import openai
import pytest

from kaon_operator.router.config import RouterConfig
from kaon_operator.router.endpoints import EndpointTable
from kaon_operator.router.proxy import Router
from kaon_operator.router.route_gateway import RouteGateway
from kaon_operator.routes.table import RouteTable
from support.router import NS, isvc, pod, serving_in_thread
from support.server import Server

SIMPLE = ["What is the capital of France?", "Who wrote Hamlet?", "How many days are in a week?"]
COMPLEX = ["Analyze step by step why the Roman Empire declined, and compare the economic and military causes.",
           "Compare quicksort and mergesort and explain why one is preferred in practice, step by step."]


@pytest.fixture(scope="module")
def tiers(tmp_path_factory):
    servers: dict[str, Server] = {}

    def start(name: str) -> None:
        servers[name] = Server(tmp_path_factory.mktemp(f"serve-{name}"), "--served-model-name", f"smollm2-{name}")

    threads = [threading.Thread(target=start, args=(n,)) for n in ("small", "large")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    yield servers
    for server in servers.values():
        server.stop()


def engine_tokens(server: Server) -> float:
    return server.metric("kaon_prompt_tokens_total") + server.metric("kaon_generation_tokens_total")


@pytest.mark.slow
def test_route_over_real_engines(tiers):
    table = EndpointTable(default_namespace=NS)
    for name, server in tiers.items():
        table.apply_service("ADDED", isvc(name, f"smollm2-{name}"))
        table.apply_pod("ADDED", pod(f"{name}-0", name, port=int(server.url.rsplit(":", 1)[1])))
    table.synced = True
    router = Router(table, RouterConfig(), rng=random.Random(0))
    routes = RouteTable(default_namespace=NS)
    routes.apply_route("ADDED", {"metadata": {"name": "assistant", "namespace": NS}, "spec": {
        "tiers": [{"service": "small", "costPerMillionTokens": 0.1}, {"service": "large", "costPerMillionTokens": 1}]}})
    router.routes = RouteGateway(router, routes)
    with serving_in_thread(router) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="tenant-a", max_retries=0)
        ask = client.chat.completions.with_raw_response.create

        def tier_of(prompt: str) -> str:
            raw = ask(model="assistant", messages=[{"role": "user", "content": prompt}], max_tokens=2)
            raw.parse()
            return raw.headers["x-kaon-route-tier"]

        assert [tier_of(p) for p in SIMPLE] == ["small"] * len(SIMPLE)
        assert [tier_of(p) for p in COMPLEX] == ["large"] * len(COMPLEX)

        request = dict(model="assistant", messages=[{"role": "user", "content": SIMPLE[0]}], max_tokens=8,
                       temperature=0)
        first = ask(**request)
        assert first.headers["x-kaon-cache"] == "miss"
        spent = engine_tokens(tiers["small"]) + engine_tokens(tiers["large"])
        second = ask(**request)
        assert second.headers["x-kaon-cache"] == "hit" and second.headers["x-kaon-route-tier"] == "small"
        assert second.content == first.content  # the same bytes: id, created and usage included
        assert engine_tokens(tiers["small"]) + engine_tokens(tiers["large"]) == spent  # no engine computed

        def streamed(key: str) -> tuple[str, list[str]]:
            c = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            with c.chat.completions.with_streaming_response.create(stream=True, **request) as raw:
                cache = raw.headers["x-kaon-cache"]
                chunks = [chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices]
            return cache, chunks

        cache, original = streamed("tenant-a")
        assert cache == "miss" and "".join(original)
        spent = engine_tokens(tiers["small"])
        cache, replay = streamed("tenant-a")
        assert cache == "hit" and replay == original  # a streamed replay, chunk by chunk
        assert engine_tokens(tiers["small"]) == spent
        assert streamed("tenant-b")[0] == "miss"  # another key never gets tenant-a's answer
        assert engine_tokens(tiers["small"]) > spent
    asyncio.run(router.routes.close())
