"""One request pipeline (server/pipeline.py): every route parses its body, checks the model it names
and shapes its errors the same way; and the protocol's models build their own SamplingParams.

The app runs in-process on a stand-in engine (a byte tokenizer, one "x" a step), so the routes are
driven through HTTP without a model.
"""
from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.llm_engine import EngineStats
from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.errors import ModelNotFoundError
from kaon_runtime.loader.tokenizer import Tokenizer
from kaon_runtime.server import protocol as p
from kaon_runtime.server.app import ServerSettings, create_app
from kaon_runtime.server.responses import ResponsesRequest

MODEL, ADAPTER = "base", "my-adapter"
BODY_LIMIT = 4096
CHAT = [{"role": "user", "content": "hi"}]


class StubEngine:
    """The LLMEngine surface AsyncEngine and the app use: each step adds an "x" to every request."""

    max_model_len = 64
    model_config = SimpleNamespace(vocab_size=256, hidden_size=8)

    def __init__(self):
        backend = Tokenizer.bytes_only(None, 0).backend
        self.tokenizer = Tokenizer(backend, bos_token_id=None, eos_token_ids=[0], add_bos=False,
                                   chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
        self.requests: dict[str, tuple[list[int], int]] = {}
        self.adapters = {ADAPTER: "/adapters/mine"}

    def lora_adapters(self):
        return list(self.adapters.items())

    def lora_id(self, adapter):
        if adapter is not None and adapter not in self.adapters:
            raise ModelNotFoundError(adapter)
        return 0 if adapter is None else 1

    def validate(self, prompt, params):
        return self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def add_validated(self, request_id, prompt_token_ids, params, lora_id=0, kv=None):
        self.requests[request_id] = (prompt_token_ids, params.max_tokens or 1)

    def abort_request(self, request_id):
        self.requests.pop(request_id, None)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        outputs = []
        for request_id, (prompt, left) in list(self.requests.items()):
            self.requests[request_id] = (prompt, left - 1)
            done = left <= 1
            if done:
                del self.requests[request_id]
            outputs.append(RequestOutput(request_id, None, prompt, [CompletionOutput(
                0, "x", [ord("x")], "length" if done else None)]))
        return outputs

    def stats(self):
        return EngineStats(len(self.requests), 0, 0.0, 0, 0, 0, 0, 0)


@pytest.fixture(scope="module")
def http():
    # The adapter routes answer the admin key only (a server without serving keys ignores it elsewhere).
    app = create_app(AsyncEngine(StubEngine()), ServerSettings(model_name=MODEL, max_body_bytes=BODY_LIMIT,
                                                               runtime_lora=True, admin_key="admin"))
    with TestClient(app, headers={"Authorization": "Bearer admin"}) as client:
        yield client


@pytest.fixture(scope="module")
def embed_http():
    app = create_app(AsyncEngine(StubEngine()), ServerSettings(model_name=MODEL, task="embed"))
    with TestClient(app) as client:
        yield client


# Each route with a valid body naming `model`.
ROUTES = {
    "/v1/completions": lambda model: {"model": model, "prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": lambda model: {"model": model, "messages": CHAT, "max_tokens": 1},
    "/v1/responses": lambda model: {"model": model, "input": "hi", "max_output_tokens": 1},
    "/tokenize": lambda model: {"model": model, "prompt": "hi"},
    "/detokenize": lambda model: {"model": model, "tokens": [104, 105]},
}


def openai_error(response) -> dict:
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("path", ROUTES)
def test_every_route_answers_an_unknown_model_with_404_model_not_found(http, path):
    """It used to fail on /tokenize and /detokenize: a 400 there, a 404 on the other routes."""
    response = http.post(path, json=ROUTES[path]("gpt-nope"))
    assert response.status_code == 404
    error = openai_error(response)
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'gpt-nope' does not exist" in error["message"]


def test_embeddings_answer_an_unknown_model_with_404_too(embed_http):
    response = embed_http.post("/v1/embeddings", json={"model": "gpt-nope", "input": "hi"})
    assert response.status_code == 404 and openai_error(response)["code"] == "model_not_found"


@pytest.mark.parametrize("path", ROUTES)
def test_the_served_model_and_a_loaded_adapter_are_served(http, path):
    for model in (MODEL, ADAPTER):
        response = http.post(path, json=ROUTES[path](model))
        assert response.status_code == 200, (model, response.text)
    if path in ("/tokenize", "/detokenize"):  # vLLM's: the model is optional there
        assert http.post(path, json={k: v for k, v in ROUTES[path](MODEL).items() if k != "model"}).status_code == 200
    else:
        assert http.post(path, json=ROUTES[path](ADAPTER)).json()["model"] == ADAPTER


def test_an_embedding_runs_on_the_base_model_so_an_adapter_name_is_unknown_there(embed_http):
    response = embed_http.post("/v1/embeddings", json={"model": ADAPTER, "input": "hi"})
    assert response.status_code == 404 and openai_error(response)["code"] == "model_not_found"


def test_a_route_of_the_other_task_is_refused_whatever_its_body(http, embed_http):
    """It used to fail on a generating server: /v1/embeddings read the body and checked the model
    first (an unknown model a 404), where an embedding server refused /v1/completions outright."""
    for client, path, body in [(http, "/v1/embeddings", {"model": "gpt-nope", "input": "hi"}),
                               (embed_http, "/v1/completions", ROUTES["/v1/completions"]("gpt-nope"))]:
        response = client.post(path, json=body)
        assert response.status_code == 400 and openai_error(response)["code"] == "wrong_task", path


PATHS = [*ROUTES, "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]


@pytest.mark.parametrize("path", PATHS)
def test_every_route_refuses_a_body_over_the_limit_with_413_request_too_large(http, path):
    """It used to fail on /tokenize and /detokenize (no code) and on the LoRA routes (no limit at all)."""
    body = json.dumps({"model": MODEL, "lora_name": "x" * (2 * BODY_LIMIT), "lora_path": "/a"})
    response = http.post(path, content=body, headers={"content-type": "application/json"})
    assert response.status_code == 413
    assert openai_error(response)["code"] == "request_too_large"


@pytest.mark.parametrize("path", PATHS)
def test_every_route_answers_bad_json_and_a_bad_field_with_a_400_naming_it(http, path):
    bad = http.post(path, content=b'{"model": ', headers={"content-type": "application/json"})
    assert bad.status_code == 400 and openai_error(bad)["message"].startswith("the body is not valid JSON")
    field = http.post(path, json={"model": 5, "lora_name": 5, "lora_path": 5, "prompt": 5, "tokens": "a"})
    error = openai_error(field)
    assert field.status_code == 400 and error["param"] is not None and error["message"].startswith(error["param"])


def test_the_document_defines_every_request_body_it_refers_to(http):
    """It used to fail: /v1/embeddings referred to an EmbeddingRequest the document did not define."""
    document = http.get("/openapi.json").json()
    refs = set(re.findall(r"#/components/schemas/(\w+)", json.dumps(document)))
    assert refs - set(document["components"]["schemas"]) == set()
    assert {"EmbeddingRequest", "LoadLoraAdapterRequest", "TokenizeRequest"} <= refs


# ---- the protocol's models build their SamplingParams -------------------------------------------


def test_a_completion_request_builds_its_sampling_params():
    body = p.CompletionRequest.model_validate({
        "model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0.5, "top_k": 3, "stop": "\n", "n": 2,
        "logprobs": 2, "logit_bias": {"7": 1.5}, "min_p": 0.1, "stop_token_ids": [9], "seed": 4,
        "response_format": {"type": "json_object"}})
    params = body.to_sampling_params()
    assert (params.max_tokens, params.temperature, params.top_k, params.top_p, params.n) == (5, 0.5, 3, 1.0, 2)
    assert (params.stop, params.logprobs, params.logit_bias, params.stop_token_ids) == (["\n"], 2, {7: 1.5}, [9])
    assert (params.min_p, params.seed, params.json_object, params.prompt_logprobs) == (0.1, 4, True, None)
    defaults = p.CompletionRequest.model_validate({"model": MODEL, "prompt": "hi"}).to_sampling_params()
    assert (defaults.max_tokens, defaults.temperature, defaults.top_p, defaults.logprobs) == (16, 1.0, 1.0, None)


@pytest.mark.parametrize(("fields", "scored"), [
    ({}, None), ({"prompt_logprobs": 3}, 3), ({"echo": True, "logprobs": 2}, 2),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 4}, 4), ({"echo": True, "max_tokens": 0}, 0),
    ({"echo": True}, None)])
def test_echo_and_prompt_logprobs_say_how_the_prompt_is_scored(fields, scored):
    body = p.CompletionRequest.model_validate({"model": MODEL, "prompt": "hi", **fields})
    assert body.to_sampling_params().prompt_logprobs == scored


def test_a_chat_request_builds_its_sampling_params():
    chat = {"model": MODEL, "messages": CHAT}
    body = p.ChatCompletionRequest.model_validate({**chat, "max_tokens": 9, "max_completion_tokens": 4,
                                                   "logprobs": True, "top_logprobs": 3})
    params = body.to_sampling_params()
    assert (params.max_tokens, params.logprobs) == (4, 3)  # max_completion_tokens over the deprecated max_tokens
    plain = p.ChatCompletionRequest.model_validate({**chat, "max_tokens": 9}).to_sampling_params()
    assert (plain.max_tokens, plain.logprobs) == (9, None)
    assert p.ChatCompletionRequest.model_validate(chat).to_sampling_params().max_tokens is None  # to the context
    schema = {"type": "object"}
    constrained = p.ChatCompletionRequest.model_validate({**chat, "response_format": {
        "type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    assert constrained.to_sampling_params().json_schema == schema
    tag = {"structures": [], "triggers": []}  # a forced call's grammar replaces the request's own constraint
    assert constrained.to_sampling_params({"structural_tag": tag}).json_schema is None


def test_a_responses_request_samples_as_its_chat_completion():
    body = ResponsesRequest.model_validate({"model": MODEL, "input": "hi", "max_output_tokens": 7, "temperature": 0})
    params = body.as_chat().to_sampling_params()
    assert (params.max_tokens, params.temperature, params.logprobs) == (7, 0.0, None)
