"""LoRA adapters through `kaon serve`, driven by the official OpenAI client: --lora-modules, model=NAME per
request, /v1/models listing adapters with their base as parent, vLLM's runtime load/unload endpoints
(behind --enable-runtime-lora and the admin key, which the serving key is not), 404 for unknown names
and 400 with the reason for an adapter that does not fit.
A tiny random llama with random peft adapters; greedy tokens equal transformers + peft merged."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from support.lora_adapters import ADAPTERS, build_adapter, build_adapters, build_base, greedy, merged
from support.server import API_KEY, Server, error_body

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
PROMPTS = {None: list(range(100, 120)), "attn": list(range(300, 312)), "mlp": list(range(1000, 1030)),
           "all": list(range(7, 30)), "qv": list(range(200, 211))}
MAX_TOKENS = 6
ADMIN_KEY = "operator-only"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def setup(tmp_path_factory, gguf_path):
    root = tmp_path_factory.mktemp("lora-serve")
    base = build_base("llama", root / "base", gguf_path)
    dirs = build_adapters(base, root, ADAPTERS)
    other = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2))
    build_adapter(other, "other", root / "other", 9, r=4, target_modules=["q_proj"])
    expected = {n: greedy(base if n is None else merged(base, dirs[n]), p, MAX_TOKENS) for n, p in PROMPTS.items()}
    # Three adapters from the start over two slots; "qv" is loaded at run time.
    server = Server(root, "--model", str(root / "base"), "--api-key", API_KEY, "--max-loras", "2",
                    "--enable-runtime-lora", "--admin-key", ADMIN_KEY, "--max-cpu-loras", "5",
                    "--lora-modules", *(f"{n}={dirs[n]}" for n in ("attn", "mlp", "all")))
    yield server, str(root / "base"), dirs, root / "other", expected
    server.stop()


def _tokens(client, model: str, prompt: list[int]) -> list[int]:
    out = client.completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                                    extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert out.model == model
    return [int(t.removeprefix("token_id:")) for t in out.choices[0].logprobs.tokens]


def test_adapters_by_name_listed_loaded_and_unloaded(setup):
    server, base, dirs, other, expected = setup
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    cards = {m.id: m.model_dump() for m in client.models.list().data}
    assert set(cards) == {base, "attn", "mlp", "all"}
    assert cards["attn"]["parent"] == base and cards["attn"]["root"] == str(dirs["attn"])
    # Base and three adapters at once over two slots, each request twice: no request gets another's adapter.
    names = [None, "attn", "mlp", "all"] * 2
    with ThreadPoolExecutor(len(names)) as pool:
        got = list(pool.map(lambda n: _tokens(client, n or base, PROMPTS[n]), names))
    assert got == [expected[n] for n in names]

    headers = ADMIN
    body = {"lora_name": "qv", "lora_path": str(dirs["qv"])}
    assert httpx.post(f"{server.url}/v1/load_lora_adapter", json=body).status_code == 401
    loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=headers)
    assert loaded.status_code == 200, loaded.text
    assert "qv" in {m.id for m in client.models.list().data}
    assert _tokens(client, "qv", PROMPTS["qv"]) == expected["qv"]
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json=body, headers=headers)
    assert again.status_code == 400 and "already loaded" in error_body(again)["message"]

    misfit = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers,
                        json={"lora_name": "other", "lora_path": str(other)})
    assert misfit.status_code == 400 and "another base model" in error_body(misfit)["message"]
    missing = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=headers,
                         json={"lora_name": "gone", "lora_path": str(other / "nowhere")})
    assert missing.status_code == 400 and "adapter_config.json" in error_body(missing)["message"]

    unloaded = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, headers=headers)
    assert unloaded.status_code == 200, unloaded.text
    with pytest.raises(openai.NotFoundError):
        _tokens(client, "qv", PROMPTS["qv"])
    unknown = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "qv"}, headers=headers)
    assert unknown.status_code == 404 and error_body(unknown)["code"] == "model_not_found"
    not_found = httpx.post(f"{server.url}/v1/chat/completions", headers=headers,
                           json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert not_found.status_code == 404 and error_body(not_found)["code"] == "model_not_found"
    assert _tokens(client, base, PROMPTS[None]) == expected[None]


def test_adapters_from_s3_at_start_and_at_run_time(setup, minio, tmp_path):
    """hf:// and s3:// adapters are downloaded into the model cache as models are (the operator loads
    spec.adapters this way); a download that fails is a 400 naming the URI, and the base keeps serving."""
    _, base, dirs, _, expected = setup
    for name in ("mlp", "qv"):
        minio.upload_dir("adapters", name, dirs[name])
    server = Server(tmp_path, "--model", base, "--max-loras", "2", "--model-cache", str(tmp_path / "cache"),
                    "--lora-modules", "mlp=s3://adapters/mlp", env={**minio.env(), "KAON_ADMIN_KEY": ADMIN_KEY,
                                                                    "KAON_ALLOW_RUNTIME_LORA_UPDATING": "true"})
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert _tokens(client, "mlp", PROMPTS["mlp"]) == expected["mlp"]
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60, headers=ADMIN,
                            json={"lora_name": "qv", "lora_path": "s3://adapters/qv"})
        assert loaded.status_code == 200, loaded.text
        assert _tokens(client, "qv", PROMPTS["qv"]) == expected["qv"]
        # Listed with the URI it was loaded from, which the operator compares with spec.adapters.
        roots = {m["id"]: m.get("root") for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert roots["qv"] == "s3://adapters/qv", roots
        missing = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60, headers=ADMIN,
                             json={"lora_name": "gone", "lora_path": "s3://adapters/nowhere"})
        assert missing.status_code == 400 and "s3://adapters/nowhere" in error_body(missing)["message"]
        assert _tokens(client, base, PROMPTS[None]) == expected[None]
    finally:
        server.stop()


def _held(server: Server, headers: dict | None = None) -> dict:
    data = httpx.get(f"{server.url}/v1/models", headers=headers or {}, timeout=10).json()["data"]
    return {m["id"]: m.get("root") for m in data if m.get("parent")}


def test_a_client_cannot_change_the_adapters(setup):
    """Issue 48 item 2, as an attacker: with the serving key, a client's load and unload (of the
    operator's adapter) were 200. Now 401 (the admin key only), and the adapters stay as they were;
    50 registrations stop at --max-cpu-loras (checked before any download), so memory is bounded."""
    server, _, dirs, _, _ = setup
    client = {"Authorization": f"Bearer {API_KEY}"}
    before = _held(server, client)
    for path, body in [("load", {"lora_name": "mine", "lora_path": str(dirs["qv"])}),
                       ("unload", {"lora_name": "attn"})]:
        for headers in (client, {}, {"Authorization": f"Bearer {ADMIN_KEY[:-1]}"}):
            response = httpx.post(f"{server.url}/v1/{path}_lora_adapter", json=body, headers=headers, timeout=60)
            assert response.status_code == 401, (path, headers, response.text)
    assert _held(server, client) == before
    # The admin key reads /v1/models (the operator's loop does), and loads up to the cap, no further.
    assert len(before) == 3 and _held(server, ADMIN) == before
    codes = [httpx.post(f"{server.url}/v1/load_lora_adapter", headers=ADMIN, timeout=60,
                        json={"lora_name": f"copy-{i}", "lora_path": str(dirs["qv"])}) for i in range(50)]
    assert [r.status_code for r in codes[:2]] == [200, 200]
    assert {r.status_code for r in codes[2:]} == {400} and "--max-cpu-loras" in error_body(codes[2])["message"]
    assert set(_held(server, ADMIN)) == {*before, "copy-0", "copy-1"}
    for name in ("copy-0", "copy-1"):
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=ADMIN, timeout=60,
                          json={"lora_name": name}).status_code == 200


@pytest.mark.parametrize("keys", [("--api-key", API_KEY), ()], ids=["serving-key", "no-key"])
def test_runtime_adapter_changes_are_off_unless_enabled(setup, tmp_path, keys):
    """Without --enable-runtime-lora the routes do not exist (404), whatever key is sent; before,
    a server without a key let anyone load and unload."""
    _, base, dirs, _, _ = setup
    server = Server(tmp_path, "--model", base, "--max-loras", "2", *keys, "--lora-modules", f"attn={dirs['attn']}")
    try:
        headers = {"Authorization": f"Bearer {API_KEY}"}
        for path, body in [("load", {"lora_name": "mine", "lora_path": str(dirs["qv"])}),
                           ("unload", {"lora_name": "attn"})]:
            response = httpx.post(f"{server.url}/v1/{path}_lora_adapter", json=body, headers=headers, timeout=60)
            assert response.status_code == 404, (path, response.text)
        assert _held(server, headers) == {"attn": str(dirs["attn"])}
    finally:
        server.stop()
