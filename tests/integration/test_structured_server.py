"""Structured output and tool calls through a real `kaon serve`, with the official openai client and LangChain.

One server for the whole module, with n-gram speculative decoding on, so every constrained
request here also runs the grammar through draft verification and rollback.
"""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import openai
import pytest

from support.router import routed, serving
from support.server import MODEL, Server
from support.structured_models import Person

KEY = "unused"

PERSON_FORMAT = {"type": "json_schema",
                 "json_schema": {"name": "person", "schema": Person.model_json_schema(), "strict": True}}
ASK_PERSON = [{"role": "user", "content": "Invent a person who lives in France. Answer in JSON."}]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("structured"), "--speculative-method", "ngram")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


def check_call(call, functions=("get_weather", "get_time")) -> dict:
    """A call is OpenAI's shape, to an offered function, with arguments valid for it."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in functions
    arguments = json.loads(call.function.arguments)
    if call.function.name == "get_weather":
        assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    else:
        assert set(arguments) == {"city"}
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 30
    return arguments


# ---- response_format ----------------------------------------------------------------------


def test_a_nested_schema_is_followed_greedy_and_streamed(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=150,
                                              response_format=PERSON_FORMAT)
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    Person.model_validate_json(choice.message.content)  # enums, pattern, ranges, bounds, no extra keys
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in client.chat.completions.create(
        model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=150, response_format=PERSON_FORMAT,
        stream=True) if chunk.choices)
    assert streamed == choice.message.content


def test_sampling_at_temperature_one_is_valid_every_time_and_seeds_repeat(client):
    def sample(seed):
        return client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=1.0, top_p=0.95,
                                              max_tokens=150, n=2, seed=seed, response_format=PERSON_FORMAT)
    first = sample(7)
    texts = [c.message.content for c in first.choices]
    for choice in first.choices:
        assert choice.finish_reason == "stop"
        Person.model_validate_json(choice.message.content)
    assert [c.message.content for c in sample(7).choices] == texts


def test_json_object_and_a_cut_at_max_tokens(client):
    response = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=100,
                                              response_format={"type": "json_object"})
    assert isinstance(json.loads(response.choices[0].message.content), dict)
    cut = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=6,
                                         response_format=PERSON_FORMAT)
    assert cut.choices[0].finish_reason == "length"
    with pytest.raises(ValueError):
        json.loads(cut.choices[0].message.content)


@pytest.mark.parametrize(("schema", "problem"), [
    ({"type": "object", "properties": {"age": {"type": "integr"}}}, "unknown type 'integr'"),
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}, "cannot be compiled"),
    ({"type": "integer", "minimum": 10, "maximum": 1}, "minimum 10 is above maximum 1"),
])
def test_an_invalid_schema_is_a_400_naming_the_problem(client, schema, problem):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=ASK_PERSON, max_tokens=5, response_format={
            "type": "json_schema", "json_schema": {"name": "bad", "schema": schema}})
    assert problem in caught.value.body["message"]


def test_completions_take_response_format_and_structured_outputs(client):
    prompt = "Q: Is the sky blue? Answer yes or no.\nA:"
    choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=1.0, seed=3,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].text in ("yes", "no")
    date = client.completions.create(model=MODEL, prompt="Today's date in ISO form:", max_tokens=20, temperature=0,
                                     extra_body={"structured_outputs": {"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"}})
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", date.choices[0].text)
    person = client.completions.create(model=MODEL, prompt="A person as JSON: ", max_tokens=150, temperature=0,
                                       extra_body={"response_format": PERSON_FORMAT})
    Person.model_validate_json(person.choices[0].text)


# ---- tools --------------------------------------------------------------------------------


def test_required_and_named_tool_choice_force_valid_calls(client):
    required = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                              temperature=0, max_tokens=120)
    choice = required.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    for call in choice.message.tool_calls:
        check_call(call)
    named = client.chat.completions.create(
        model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=1.0, seed=11, max_tokens=120, n=2,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    for choice in named.choices:
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        check_call(choice.message.tool_calls[0], functions=("get_time",))
    single = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                            parallel_tool_calls=False, temperature=0, max_tokens=120)
    assert len(single.choices[0].message.tool_calls) == 1


def test_none_and_auto(client):
    none = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=30)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content
    auto = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=0,
                                          max_tokens=120)
    message = auto.choices[0].message
    if message.tool_calls:  # the model chose a call: it parsed, so it is a valid one
        assert auto.choices[0].finish_reason == "tool_calls"
        for call in message.tool_calls:
            check_call(call)
    else:
        assert (message.content and "<tool_call>" not in message.content) or auto.choices[0].finish_reason == "length"


def test_streamed_tool_call_deltas_reassemble_to_the_whole_response(client):
    kwargs = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0,
                  max_tokens=120)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            for delta in choice.delta.tool_calls or []:
                if delta.index not in calls:  # the first chunk of a call names it
                    assert delta.id and delta.type == "function" and delta.function.name
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.id is None and not delta.function.name
                calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for _, c in sorted(calls.items())] == [
        (c.function.name, c.function.arguments) for c in whole]
    with client.chat.completions.stream(**kwargs) as stream:  # the openai client's own reassembly
        final = stream.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole]


def test_parallel_calls_end_and_a_cut_keeps_the_whole_calls(client):
    many = [{"role": "user", "content": "What is the weather in Paris, Lyon, Nice, Lille, Brest and Metz?"}]
    forced = dict(model=MODEL, messages=many, tools=TOOLS, tool_choice="required", temperature=1.0, max_tokens=400,
                  logprobs=True)
    several = None
    for seed in range(6):  # a small model left to call in parallel would go on until max_tokens
        choice = client.chat.completions.create(seed=seed, **forced).choices[0]
        assert choice.finish_reason == "tool_calls" and 1 <= len(choice.message.tool_calls) <= 4
        for call in choice.message.tool_calls:
            check_call(call)
        if several is None and len(choice.message.tool_calls) > 1:
            several = seed, choice
    assert several, "no reply with several calls: nothing to cut between calls"
    # The same seed again, cut a few tokens into the second call: the first stays, the second goes.
    seed, choice = several
    tokens = [t.token for t in choice.logprobs.content]
    first_end = next(i for i in range(len(tokens)) if "</tool_call>" in "".join(tokens[:i + 1]))
    cut = client.chat.completions.create(seed=seed, **{**forced, "max_tokens": first_end + 5}).choices[0]
    assert cut.finish_reason == "length"
    assert [(c.function.name, c.function.arguments) for c in cut.message.tool_calls] == [
        (choice.message.tool_calls[0].function.name, choice.message.tool_calls[0].function.arguments)]


# ---- frameworks and the router ------------------------------------------------------------


def test_langchain_structured_output_and_bound_tools(server):
    chat_openai = pytest.importorskip("langchain_openai")
    llm = chat_openai.ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key=KEY, temperature=0,
                                 max_tokens=150, max_retries=0)
    person = llm.with_structured_output(Person).invoke(ASK_PERSON[0]["content"])
    assert isinstance(person, Person)
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke(ASK_WEATHER[0]["content"])
    assert [c["name"] for c in message.tool_calls] == ["get_weather"]
    assert set(message.tool_calls[0]["args"]) == {"city", "unit"}


def test_the_router_passes_structured_requests_through_unchanged(server):
    body = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required", "temperature": 0,
            "max_tokens": 120}
    direct = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()

    class Engine:  # the real server, as the router's pod table sees it
        name, port = "kaon-0", int(server.url.rsplit(":", 1)[1])

    async def through_router():
        async with serving(routed(Engine(), served_name=MODEL)) as session:
            async with session.post("/v1/chat/completions", json=body) as response:
                assert response.status == 200
                return await response.json()

    routed_body = asyncio.run(asyncio.wait_for(through_router(), 120))

    def strip(b):  # what differs between two responses to one request: the ids and the clock
        return [(c["message"]["content"], [(t["function"]["name"], t["function"]["arguments"])
                                           for t in c["message"]["tool_calls"]], c["finish_reason"])
                for c in b["choices"]]
    assert strip(routed_body) == strip(direct) and direct["choices"][0]["finish_reason"] == "tool_calls"
