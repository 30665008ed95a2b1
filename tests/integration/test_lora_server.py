"""LoRA adapters through `kaon serve`, driven by the official OpenAI client: --lora-modules, model=NAME per
request, /v1/models listing adapters with their base as parent, vLLM's runtime load/unload endpoints
(behind the API key), 404 for unknown names and 400 with the reason for an adapter that does not fit.
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

    headers = {"Authorization": f"Bearer {API_KEY}"}
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
                    "--lora-modules", "mlp=s3://adapters/mlp", env=minio.env())
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert _tokens(client, "mlp", PROMPTS["mlp"]) == expected["mlp"]
        loaded = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                            json={"lora_name": "qv", "lora_path": "s3://adapters/qv"})
        assert loaded.status_code == 200, loaded.text
        assert _tokens(client, "qv", PROMPTS["qv"]) == expected["qv"]
        # Listed with the URI it was loaded from, which the operator compares with spec.adapters.
        roots = {m["id"]: m.get("root") for m in httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]}
        assert roots["qv"] == "s3://adapters/qv", roots
        missing = httpx.post(f"{server.url}/v1/load_lora_adapter", timeout=60,
                             json={"lora_name": "gone", "lora_path": "s3://adapters/nowhere"})
        assert missing.status_code == 400 and "s3://adapters/nowhere" in error_body(missing)["message"]
        assert _tokens(client, base, PROMPTS[None]) == expected[None]
    finally:
        server.stop()
