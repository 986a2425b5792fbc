"""Structured outputs and tool calling over HTTP, on the tiny random-weight model: every
request surface, the 400s, the official openai SDK (parse, tools, streaming tool calls),
LangChain, and a mixed load."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from server_args import MODEL, TINY_SERVER_ARGS, start_server

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "temperature": {"type": "integer", "minimum": -30, "maximum": 45},
    "sunny": {"type": "boolean"}}, "required": ["city", "temperature", "sunny"]}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                    "days": {"type": "integer", "minimum": 1,
                                                             "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "tz": {"enum": ["UTC", "CET", "PST"]}}, "required": ["tz"]}}}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    s = start_server(tmp_path_factory, "so_server",
                     ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                      "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
                      # a misspelt guided_* field is a 400 here (by default: a warning)
                      "--reject-unknown-fields"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="x", max_retries=0,
                         timeout=120)


def post(server, path, body):
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body}, timeout=120)


# ------------------------------------------------------------------ the request surfaces
def test_every_request_surface_constrains(client):
    chat = dict(model=MODEL, messages=MSG, temperature=1.0, seed=7, max_tokens=200)
    r = client.chat.completions.create(**chat, response_format={
        "type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(**chat, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(
        json.loads(r.choices[0].message.content), dict)
    r = client.chat.completions.create(**chat, extra_body={"structured_outputs": {"json": SCHEMA}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.chat.completions.create(**chat, extra_body={"guided_json": SCHEMA})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    c = client.completions.create(model=MODEL, prompt="Phone:", max_tokens=30, temperature=1.0,
                                  n=3, extra_body={"guided_regex": r"\d{3}-\d{4}"})
    assert all(re.fullmatch(r"\d{3}-\d{4}", ch.text) for ch in c.choices)
    c = client.completions.create(model=MODEL, prompt="Mood:", max_tokens=30, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["happy", "sad"]}})
    assert c.choices[0].text in ("happy", "sad")
    c = client.completions.create(model=MODEL, prompt="Mood:", max_tokens=30, temperature=1.0,
                                  extra_body={"guided_choice": ["up", "down"]})
    assert c.choices[0].text in ("up", "down")
    c = client.completions.create(model=MODEL, prompt="Sum:", max_tokens=40, temperature=1.0,
                                  extra_body={"guided_grammar": 'root ::= [0-9]+ "+" [0-9]+'})
    assert re.fullmatch(r"\d+\+\d+", c.choices[0].text)


def test_streamed_constrained_output_is_valid(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, temperature=1.0, seed=3, max_tokens=200, stream=True,
        extra_body={"guided_json": SCHEMA})
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    jsonschema.validate(json.loads(text), SCHEMA)


def test_sdk_parse_with_a_pydantic_model(client):
    class Weather(BaseModel):
        city: str = Field(max_length=8)
        temperature: int = Field(ge=-30, le=45)
        sunny: bool

    r = client.chat.completions.parse(model=MODEL, messages=MSG, response_format=Weather,
                                      max_tokens=200, temperature=1.0, seed=11)
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Weather) and -30 <= parsed.temperature <= 45


# ------------------------------------------------------------------ bad input: 400s
@pytest.mark.parametrize("extra,words", [
    ({"guided_json": {"type": "foo"}}, "JSON schema is invalid"),
    ({"guided_regex": "a(b"}, "regex does not compile"),
    ({"guided_grammar": "root ::= \"a\" |"}, "EBNF grammar has an error"),
    ({"guided_choice": []}, "non-empty list"),
    ({"guided_json": {"type": "array", "uniqueItems": True}}, "cannot enforce"),
    ({"guided_jsn": {"type": "object"}}, "unknown field(s) 'guided_jsn'"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "in 2 ways"),
    ({"response_format": {"type": "json_schema"}}, "json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "'yaml' is not supported"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "xgrammar"),
    ({"structured_outputs": {"jsonn": {}}}, "unsupported key(s) jsonn"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function",
                                               "function": {"name": "nope"}}}, "not in tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "guided_regex": "a"},
     "do not also send"),
])
def test_bad_structured_requests_are_400_with_a_message(server, extra, words):
    r = post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 5, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and err["type"] == "invalid_request_error"
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------ tools
def test_named_and_required_tool_choice_always_parse(client):
    r = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER_TOOL, TIME_TOOL], max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content is None
    (call,) = ch.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments),
                        WEATHER_TOOL["function"]["parameters"])
    r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", max_tokens=300, temperature=1.0,
                                       seed=5, parallel_tool_calls=False)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and len(calls) == 1
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER_TOOL, TIME_TOOL)}
    jsonschema.validate(json.loads(calls[0].function.arguments), schemas[calls[0].function.name])


def test_tool_choice_none_and_auto_answer_text_on_a_model_that_does_not_call(client):
    for choice in ("none", "auto"):
        r = client.chat.completions.create(model=MODEL, messages=MSG, tools=[WEATHER_TOOL],
                                           tool_choice=choice, max_tokens=8, temperature=0.0)
        ch = r.choices[0]
        assert ch.message.tool_calls is None and ch.finish_reason in ("stop", "length")


def test_streaming_tool_calls_accumulate_like_openai(client):
    stream = client.chat.completions.create(
        model=MODEL, messages=MSG, tools=[WEATHER_TOOL], stream=True, max_tokens=200,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0)
    ids, name, args, finish = set(), "", "", None
    for chunk in stream:
        for ch in chunk.choices:
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                ids.add(d.id) if d.id else None
                name += (d.function.name or "") if d.function else ""
                args += (d.function.arguments or "") if d.function else ""
            finish = ch.finish_reason or finish
    assert len(ids) == 1 and name == "get_weather" and finish == "tool_calls"
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])


def test_tool_messages_in_the_history_are_accepted(client):
    msgs = MSG + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C and sunny"}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL],
                                       tool_choice="none", max_tokens=4, temperature=0.0)
    assert r.choices[0].message.content is not None


# ------------------------------------------------------------------ LangChain
def test_langchain_structured_output_and_bind_tools(server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    class Answer(BaseModel):
        city: str = Field(max_length=8)
        confident: bool

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.base_url}/v1", api_key="x",
                     temperature=1.0, max_tokens=200, max_retries=0)
    answer = llm.with_structured_output(Answer).invoke("Which city?")
    assert isinstance(answer, Answer)
    bound = llm.bind_tools([WEATHER_TOOL], tool_choice="get_weather")
    msg = bound.invoke("Weather in Paris?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    jsonschema.validate(msg.tool_calls[0]["args"], WEATHER_TOOL["function"]["parameters"])


# ------------------------------------------------------------------ under load
def test_mixed_load_constrained_valid_unconstrained_unaffected(server):
    schemas = [{"type": "object", "properties": {f"k{i}": {"type": "integer", "minimum": 0,
                                                           "maximum": 10 ** (i % 4 + 1)},
                                                 "s": {"type": "string", "maxLength": 4}},
                "required": [f"k{i}", "s"]} for i in range(8)]
    prompts = [f"Request number {i} says" for i in range(64)]

    async def one(http, body):
        r = await http.post("/v1/completions", json={"model": MODEL, **body})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    async def run(bodies):
        async with httpx.AsyncClient(base_url=server.base_url, timeout=600) as http:
            return await asyncio.gather(*(one(http, b) for b in bodies))

    plain = [{"prompt": p, "max_tokens": 12, "temperature": 0.0, "ignore_eos": True}
             for p in prompts]
    constrained = [{"prompt": p, "max_tokens": 120, "temperature": 1.0, "seed": i,
                    "guided_json": schemas[i % 8]} for i, p in enumerate(prompts)]
    alone = asyncio.run(run(plain))
    mixed = asyncio.run(run([b for pair in zip(constrained, plain) for b in pair]))
    for i, ch in enumerate(mixed[0::2]):
        assert ch["finish_reason"] == "stop", ch
        jsonschema.validate(json.loads(ch["text"]), schemas[i % 8])
    assert [c["text"] for c in mixed[1::2]] == [c["text"] for c in alone]
