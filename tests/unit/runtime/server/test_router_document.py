"""The router's own answers are valid in the engine's OpenAPI document: it speaks the engine's API
(docs/routing.md), so a client generated from /openapi.json reads the router's /v1/models, its
probes and its errors as it reads the engine's. (tests/integration/test_fuzz_router.py checks the
same through schemathesis against a real engine.)"""
from __future__ import annotations

from kaon_runtime.server import protocol as p
from support.router import FakeEngine, routed, run, serving


def test_the_models_list_probes_and_errors_parse_as_the_engine_documents_them():
    async def scenario():
        engine = await FakeEngine("a").start()
        async with serving(routed(engine)) as client:
            async with client.get("/v1/models") as resp:
                models = await resp.json()
            async with client.get("/health") as resp:
                health = await resp.json()
            async with client.post("/v1/completions", data=b'{"model": "nobody", "prompt": "x"}') as resp:
                missing = resp.status, await resp.json()
        await engine.stop()
        return models, health, missing

    models, health, (status, error) = run(scenario())
    # It used to fail here: the engine's card required max_model_len, which the router cannot know.
    assert [card.id for card in p.ModelList.model_validate(models).data] == ["m"]
    assert health == {"status": "ok"}
    assert status == 404 and p.ErrorResponse.model_validate(error).error.code == "model_not_found"
