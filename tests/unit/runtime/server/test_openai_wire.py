"""OpenAI's and vLLM's wire format where a strict client found kaon short (sweepapi): a batch of prompts
in one completion, vLLM's guided_* fields, /version, an error's `param` and `code`."""
from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient

from kaon_runtime.engine.async_engine import AsyncEngine
from kaon_runtime.engine.outputs import CompletionOutput, RequestOutput
from kaon_runtime.errors import InvalidRequestError
from kaon_runtime.sampling import SamplingParams
from kaon_runtime.server import protocol as p
from kaon_runtime.server.app import ServerSettings, create_app
from tests.unit.runtime.server.test_pipeline import ADAPTER, CHAT, MODEL, StubEngine, openai_error


class LengthCheckingEngine(StubEngine):
    """The stub, with the real engine's context check and its error code, and cumulative outputs as the
    real engine's (the text so far: "x", "xx", ...)."""

    def validate(self, prompt, params):
        ids = super().validate(prompt, params)
        if len(ids) >= self.max_model_len:
            raise InvalidRequestError(f"the prompt has {len(ids)} tokens", code="context_length_exceeded")
        return ids

    def add_validated(self, request_id, prompt_token_ids, params, lora_id=0, kv=None):
        super().add_validated(request_id, prompt_token_ids, params, lora_id, kv)
        self.wanted[request_id] = params.max_tokens or 1

    def step(self):
        if self.held_back is not None and not self.held_back.is_set():  # HELD's requests make no output until set
            held = {r: entry for r, entry in self.requests.items() if entry[0] == HELD}
            for request_id in held:
                del self.requests[request_id]
            try:
                return self._step()
            finally:
                self.requests.update(held)
        self.held_started = self.held_started or any(entry[0] == HELD for entry in self.requests.values())
        return self._step()

    def _step(self):
        outputs = []
        for o in super().step():
            made = self.wanted[o.request_id] - self.requests.get(o.request_id, (None, 0))[1]
            outputs.append(RequestOutput(o.request_id, None, o.prompt_token_ids, [CompletionOutput(
                0, "x" * made, [ord("x")] * made, o.outputs[0].finish_reason)]))
        return outputs

    def __init__(self):
        super().__init__()
        self.wanted: dict[str, int] = {}
        self.held_back: threading.Event | None = None  # set: HELD's requests run again
        self.held_started = False  # a HELD request has made an output


HELD = [9, 9, 9]  # a prompt whose first token the engine holds back while LengthCheckingEngine.held_back is unset


@pytest.fixture(scope="module")
def http():
    with TestClient(create_app(AsyncEngine(LengthCheckingEngine()), ServerSettings(model_name=MODEL))) as client:
        yield client


def test_a_batch_of_prompts_is_one_response_with_each_prompts_choices_in_order(http):
    """It used to be a 400 ("batched prompts are not supported"), where OpenAI and vLLM answer it."""
    for prompts, prompt_tokens in ((["hi", "hello"], 2 + 5), ([[104, 105], [104]], 3)):
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": prompts, "max_tokens": 2})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert [c["text"] for c in body["choices"]] == ["xx", "xx"]  # the stub adds an "x" a step
        assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 4,
                                 "total_tokens": prompt_tokens + 4, "prompt_tokens_details": {"cached_tokens": 0}}
    echoed = http.post("/v1/completions", json={"model": MODEL, "prompt": ["ab", "cde"], "max_tokens": 1,
                                                 "echo": True}).json()
    assert [c["text"] for c in echoed["choices"]] == ["abx", "cdex"]  # each choice echoes its own prompt


def test_a_streamed_batch_interleaves_the_prompts_under_one_id_then_sums_the_usage(http):
    body = {"model": MODEL, "prompt": ["hi", "hello", "hey"], "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as reply:
        assert reply.status_code == 200
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    texts: dict[int, str] = {}
    for chunk in chunks[:-1]:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "xxx", 1: "xxx", 2: "xxx"}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens"] == 2 + 5 + 3
    assert chunks[-1]["usage"]["completion_tokens"] == 9


def test_a_streamed_batch_starts_when_its_first_prompt_has_a_token_not_its_last(http):
    """The stream's head used to wait for every prompt's first token (with many prompts, the client waited for
    all of them); OpenAI and vLLM stream each choice as it comes. Here the engine holds the second prompt's first
    token back until the client has read a chunk (a timer lets it go in the end, so that a server that waits
    fails here instead of hanging)."""
    engine = http.app.state.engine.engine
    engine.held_back, engine.held_started = threading.Event(), False
    backstop = threading.Timer(10, engine.held_back.set)
    backstop.start()
    try:
        body = {"model": MODEL, "prompt": [[104, 105], HELD], "max_tokens": 2, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as reply:
            events = (line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: "))
            first = json.loads(next(events))
            held_started_before_the_first_chunk = engine.held_started
            engine.held_back.set()
            rest = list(events)
    finally:
        backstop.cancel()
        engine.held_back = None
    assert not held_started_before_the_first_chunk
    assert [c["index"] for c in first["choices"]] == [0]  # the prompt that had a token
    assert rest[-1] == "[DONE]"
    texts: dict[int, str] = {}
    for chunk in [first, *map(json.loads, rest[:-1])]:
        assert chunk["id"] == first["id"] and chunk["object"] == "text_completion"
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: "xx", 1: "xx"}


def test_a_bad_prompt_in_a_batch_refuses_the_request_and_runs_none_of_it(http):
    engine = http.app.state.engine.engine
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": ["hi", "x" * 100], "max_tokens": 1})
    assert reply.status_code == 400 and openai_error(reply)["code"] == "context_length_exceeded"
    assert not engine.requests  # the first prompt, already queued, was aborted
    # More prompts than the queue holds (256 by default) could never be admitted: a 400, not a 429 to retry.
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": ["hi"] * 257, "max_tokens": 1})
    assert reply.status_code == 400 and openai_error(reply)["param"] == "prompt"
    assert "at most 256 (each waits in the queue: --max-queue)" in openai_error(reply)["message"]
    assert not engine.requests


def test_a_wrong_type_in_a_union_field_names_the_field_not_pydantics_arm(http):
    """`stop: 5` was answered with param "stop.str"; OpenAI's clients read `param` as the field."""
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "stop": 5})
    assert reply.status_code == 400 and openai_error(reply)["param"] == "stop"
    parts = [{"type": "text", "text": "see"}, {"type": "image_url", "image_url": {"url": "x"}}]
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": parts}]})
    assert reply.status_code == 400 and openai_error(reply)["param"] == "messages.0"
    assert "'image_url' are not supported: this server takes text parts only" in openai_error(reply)["message"]


def test_version_and_ping_answer_as_vllms_do(http):
    reply = http.get("/version")
    assert reply.status_code == 200 and isinstance(reply.json()["version"], str)
    assert http.get("/ping").json() == http.post("/ping").json() == {"status": "ok"}


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize(("fields", "expected"), [
    ({"guided_json": SCHEMA}, {"json_schema": SCHEMA}),
    ({"guided_regex": "[ab]+"}, {"regex": "[ab]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "a"', "guided_decoding_backend": "xgrammar"}, {"grammar": 'root ::= "a"'}),
])
def test_vllms_guided_fields_constrain_the_output_like_structured_outputs(fields, expected):
    """They were unknown fields, ignored: guided_json gave free text."""
    for request in (p.CompletionRequest(model=MODEL, prompt="hi", **fields),
                    p.ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}], **fields)):
        assert request.output_constraint() == expected
        assert not request.model_extra
        params = request.to_sampling_params() if isinstance(request, p.CompletionRequest) else \
            request.to_sampling_params(request.output_constraint())
        name, value = next(iter(expected.items()))
        assert getattr(params, name) == value


def test_guided_fields_with_another_constraint_are_refused(http):
    for other in ({"structured_outputs": {"regex": "a"}}, {"response_format": {"type": "json_object"}}):
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "guided_regex": "b", **other})
        assert reply.status_code == 400, reply.text


def test_kaon_version_prints_the_release(capsys):
    """`kaon --version` was "the following arguments are required: command"."""
    from kaon_runtime.cli import build_parser
    from kaon_runtime.version import package_version

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == f"kaon {package_version()}"


def _streamed_text(http, body) -> dict[int, str]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        events = [line.removeprefix("data: ") for line in reply.iter_lines() if line.startswith("data: ")]
    texts: dict[int, str] = {}
    for chunk in map(json.loads, events[:-1]):
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def test_echo_streams_the_prompt_first_as_the_whole_response_has_it(http):
    """echo with stream was refused ("echo is not supported with stream"); vLLM streams it."""
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "echo": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert whole == "abcxxx" and _streamed_text(http, body) == {0: whole}
    assert _streamed_text(http, {**body, "prompt": ["ab", "c"]}) == {0: "abxxx", 1: "cxxx"}


def test_an_explicit_null_is_the_fields_default_as_in_openais_api(http):
    """`"n": null` and the like were a 400 ("n: Input should be a valid integer"); OpenAI's optional
    parameters are nullable and clients that serialize every field send them."""
    nulls = {name: None for name in ("n", "temperature", "top_p", "stop", "presence_penalty", "frequency_penalty",
                                     "logit_bias", "seed", "stream", "logprobs", "user", "repetition_penalty")}
    chat = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "max_tokens": 2, **nulls, "top_logprobs": None, "tools": None})
    assert chat.status_code == 200, chat.text
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    completion = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2, **nulls,
                                                     "echo": None})
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == "xx"
    required = http.post("/v1/completions", json={"model": None, "prompt": "hi"})
    assert required.status_code == 400 and openai_error(required)["param"] == "model"


def test_an_assistant_message_sent_back_as_openais_client_dumped_it_is_accepted(http):
    """`messages.append(reply.choices[0].message.model_dump())` adds refusal, annotations, audio and
    function_call (null); each was a 400 "Extra inputs are not permitted"."""
    dumped = {"role": "assistant", "content": "Hello", "refusal": None, "annotations": None, "audio": None,
              "function_call": None, "tool_calls": None}
    reply = http.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, "messages": [
        {"role": "user", "content": "hi"}, dumped, {"role": "user", "content": "again"}]})
    assert reply.status_code == 200, reply.text


def test_a_model_is_retrieved_by_its_id_as_openais_client_asks(http):
    """client.models.retrieve(id) (GET /v1/models/{id}) was a 404 for the served model too."""
    for name in (MODEL, ADAPTER):
        reply = http.get(f"/v1/models/{name}")
        assert reply.status_code == 200 and reply.json()["id"] == name and reply.json()["object"] == "model"
    assert http.get("/v1/models/org/with/slashes").status_code == 404
    assert openai_error(http.get("/v1/models/nope"))["code"] == "model_not_found"


def test_top_k_minus_one_is_off_as_in_vllm(http):
    """vLLM's clients send top_k -1 (its older "off"); it was a 400 here."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert p.CompletionRequest(model=MODEL, prompt="hi", top_k=-1).to_sampling_params().top_k == 0
    reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1, "top_k": -1})
    assert reply.status_code == 200, reply.text
    assert http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "top_k": -2}).status_code == 400


def test_a_streamed_response_opens_its_message_before_the_text_as_openai_does(http):
    """The stream sent output_text.delta with no output_item.added before it: the openai client's
    responses.stream() raised "Received a content event for output index 0 before receiving its output item"."""
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 3, "stream": True}
    with http.stream("POST", "/v1/responses", json=body) as reply:
        events = [json.loads(line.removeprefix("data: ")) for line in reply.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]  # as many as the outputs read
    assert kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * len(deltas),
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]["output"][0]
    assert "".join(d["delta"] for d in deltas) == "xxx" == events[-4]["text"] == final["content"][0]["text"]
    assert events[-2]["item"] == final and events[2]["item"]["id"] == final["id"]


def test_vllms_allowed_token_ids_bad_words_and_truncate_prompt_tokens_reach_the_engine(http, monkeypatch):
    """vLLM takes these three as extra fields of /v1/completions and /v1/chat/completions; they were ignored
    here (named in x-kaon-ignored-fields). Their effect on the tokens: test_engine.py, on the real model."""
    engine, seen = http.app.state.engine.engine, []
    validate = engine.validate
    monkeypatch.setattr(engine, "validate", lambda prompt, params: seen.append(params) or validate(prompt, params))
    extra = {"allowed_token_ids": [104, 120], "bad_words": ["no"], "truncate_prompt_tokens": 3}
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": CHAT})):
        reply = http.post(path, json={"model": MODEL, "max_tokens": 1, **body, **extra})
        assert reply.status_code == 200, reply.text
        assert "x-kaon-ignored-fields" not in reply.headers
        assert (seen[-1].allowed_token_ids, seen[-1].bad_words, seen[-1].truncate_prompt_tokens) == ([104, 120],
                                                                                                      ["no"], 3)
    for bad in ({"truncate_prompt_tokens": 0}, {"truncate_prompt_tokens": -2}, {"allowed_token_ids": []},
                {"bad_words": "no"}):
        reply = http.post("/v1/completions", json={"model": MODEL, "prompt": "hi", **bad})
        assert reply.status_code == 400, (bad, reply.text)
