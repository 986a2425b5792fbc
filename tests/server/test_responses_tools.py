"""Function tools on /v1/responses, as Responses API clients use them (the openai SDK's
responses.create / parse / stream, LangChain's ChatOpenAI(use_responses_api=True)), on the tiny
random-weight model: it writes gibberish, so the calls come from tool_choice "required" or a
named function, which the chat path enforces with structured output. What is checked is what a
client notices: the function_call output items and their arguments (valid for the schema),
the stream's events in OpenAI's order with consistent sequence numbers and output indexes, the
SDK's accumulated final response, function_call / function_call_output input items reaching
the prompt, and the 400s for what the server does not do."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from llmtower.server.protocol_responses import OutputFunctionCall, OutputMessage
from llmtower.server.serving_responses import _StreamItems, _output_items
from server_args import MODEL

WEATHER_SCHEMA = {"type": "object",
                  "properties": {"city": {"type": "string", "maxLength": 8},
                                 "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "PST"]}},
               "required": ["tz"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": WEATHER_SCHEMA, "strict": True}
TIME = {"type": "function", "name": "get_time", "parameters": TIME_SCHEMA, "strict": True}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
ASK = "What is the weather in Paris?"
SAMPLED = dict(temperature=1.0, max_output_tokens=200)


class GetTime(BaseModel):
    """The time in a time zone."""

    tz: str = Field(pattern="^(UTC|CET|PST)$")


def _check_call(item, names=tuple(SCHEMAS)) -> dict:
    """A function_call output item as the SDK parsed it; returns its arguments."""
    assert item.type == "function_call" and item.status == "completed"
    assert item.name in names and item.call_id.startswith("call_") and item.id.startswith("fc_")
    args = json.loads(item.arguments)
    jsonschema.validate(args, SCHEMAS[item.name])
    return args


# ------------------------------------------------------------------ not streamed
def test_a_named_function_is_called_and_the_request_is_echoed(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], **SAMPLED,
                                tool_choice={"type": "function", "name": "get_weather"})
    assert r.status == "completed" and r.usage.output_tokens > 0
    (item,) = r.output  # no message item: the model wrote nothing but the call
    _check_call(item, ("get_weather",))
    assert r.output_text == ""
    assert [t.name for t in r.tools] == ["get_weather", "get_time"]
    assert r.tools[0].parameters == WEATHER_SCHEMA and r.tools[0].type == "function"
    assert r.tool_choice.type == "function" and r.tool_choice.name == "get_weather"
    assert r.parallel_tool_calls is True


def test_required_calls_one_of_the_tools_and_parse_gives_pydantic_arguments(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], **SAMPLED,
                                tool_choice="required", parallel_tool_calls=False)
    (item,) = r.output
    _check_call(item)
    assert r.parallel_tool_calls is False and r.tool_choice == "required"
    # Several calls when parallel calls are allowed: distinct ids, every one valid.
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], extra_body={"seed": 3},
                                tool_choice="required", temperature=1.0, max_output_tokens=300)
    assert r.status == "completed" and r.output
    for item in r.output:
        _check_call(item)
    assert len({i.call_id for i in r.output}) == len({i.id for i in r.output}) == len(r.output)
    # The SDK's parse: the pydantic tool's arguments come back as the model.
    parsed = client.responses.parse(model=MODEL, input="Time?", **SAMPLED,
                                    tools=[openai.pydantic_function_tool(GetTime)],
                                    tool_choice={"type": "function", "name": "GetTime"})
    (call,) = parsed.output
    assert isinstance(call.parsed_arguments, GetTime)
    assert call.parsed_arguments.tz in ("UTC", "CET", "PST")


def test_tool_choice_none_answers_with_a_message(client):
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], tool_choice="none",
                                max_output_tokens=5, temperature=0.0)
    (item,) = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.output_text == item.content[0].text and r.usage.output_tokens > 0
    assert r.tool_choice == "none" and [t.name for t in r.tools] == ["get_weather"]
    # The same greedy text as without tools (this template does not render them).
    plain = client.responses.create(model=MODEL, input=ASK, max_output_tokens=5,
                                    temperature=0.0)
    assert plain.output_text == r.output_text


# ------------------------------------------------------------------ streamed
def _check_stream_order(events):
    """Sequence numbers 0.. in order; every item is added, has its deltas, is done, in turn."""
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    open_index = None
    for e in events[1:-1]:
        if e.type == "response.output_item.added":
            assert open_index is None
            open_index = e.output_index
        elif e.type == "response.output_item.done":
            assert e.output_index == open_index
            open_index = None
        elif e.type != "response.in_progress":
            assert e.output_index == open_index, e.type
    assert open_index is None


def test_streamed_named_call_events_and_the_sdk_stream_helper(client):
    with client.responses.stream(model=MODEL, input="Time?", **SAMPLED,
                                 tools=[openai.pydantic_function_tool(GetTime)],
                                 tool_choice={"type": "function", "name": "GetTime"}) as s:
        events = list(s)
        final = s.get_final_response()
    _check_stream_order(events)
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert kinds[3:3 + len(deltas)] == ["response.function_call_arguments.delta"] * len(deltas)
    assert kinds[3 + len(deltas):] == ["response.function_call_arguments.done",
                                       "response.output_item.done", "response.completed"]
    added, done_args, done = events[2], events[-3], events[-2]
    assert added.item.type == "function_call" and added.item.name == "GetTime"
    assert added.item.arguments == "" and added.item.status == "in_progress"
    assert deltas and "".join(e.delta for e in deltas) == done_args.arguments
    assert {e.item_id for e in [*deltas, done_args]} == {added.item.id}
    assert done.item.status == "completed" and done.item.arguments == done_args.arguments
    assert (done.item.id, done.item.call_id) == (added.item.id, added.item.call_id)
    # The helper's accumulated response: the call, with its arguments parsed.
    (call,) = final.output
    assert call.type == "function_call" and call.call_id == added.item.call_id
    assert call.arguments == done_args.arguments
    assert isinstance(call.parsed_arguments, GetTime)
    assert final.usage.output_tokens > 0 and final.status == "completed"


def test_streamed_required_calls_match_the_final_response(client):
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                          tool_choice="required", extra_body={"seed": 3}, temperature=1.0,
                                          max_output_tokens=300, stream=True))
    _check_stream_order(events)
    final = events[-1].response
    added = [e.item for e in events if e.type == "response.output_item.added"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.type for i in added] == ["function_call"] * len(final.output) and added
    assert [i.model_dump() for i in done] == [i.model_dump() for i in final.output]
    for index, item in enumerate(final.output):
        _check_call(item)
        args = "".join(e.delta for e in events if e.type ==
                       "response.function_call_arguments.delta" and e.output_index == index)
        assert args == item.arguments
    # Streamed or not, the same seeded answer.
    r = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME],
                                tool_choice="required", extra_body={"seed": 3}, temperature=1.0,
                                max_output_tokens=300)
    assert [(i.name, i.arguments) for i in r.output] == \
        [(i.name, i.arguments) for i in final.output]


def test_streamed_tool_choice_none_is_a_message_stream(client):
    events = list(client.responses.create(model=MODEL, input=ASK, tools=[WEATHER],
                                          tool_choice="none", max_output_tokens=5,
                                          temperature=0.0, stream=True))
    _check_stream_order(events)
    assert not [e for e in events if "function_call" in e.type]
    (message,) = events[-1].response.output
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert message.type == "message" and message.content[0].text == text


def test_raw_events_and_responses_validate_as_the_sdk_types(tiny_server):
    """Validated (not constructed, as the SDK's client does) against the SDK's own types."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    url = f"{tiny_server.base_url}/v1/responses"
    for choice in ("required", {"type": "function", "name": "get_time"}, "none"):
        body = dict(model=MODEL, input="Time?", tools=[WEATHER, TIME], tool_choice=choice, seed=3,
                    **SAMPLED)
        with httpx.stream("POST", url, json={**body, "stream": True}, timeout=60) as r:
            events = [adapter.validate_python(json.loads(line[len("data: "):]))
                      for line in r.iter_lines() if line.startswith("data: ")]
        _check_stream_order(events)
        kind = "message" if choice == "none" else "function_call"
        assert {e.item.type for e in events if e.type == "response.output_item.done"} == {kind}
        r = Response.model_validate(httpx.post(url, json=body, timeout=60).json())
        assert r.output and all(i.type == kind for i in r.output)


# ------------------------------------------------------------------ round trip
def test_function_call_and_its_output_reach_the_prompt(client, tiny_server):
    first = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], **SAMPLED,
                                    tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    history = [{"role": "user", "content": ASK}, call.model_dump(exclude_none=True)]

    def answer(result: str, tool_choice: str, max_output_tokens: int = 3):
        return client.responses.create(
            model=MODEL, tools=[WEATHER], max_output_tokens=max_output_tokens,
            temperature=1.0 if tool_choice == "required" else 0.0, tool_choice=tool_choice,
            input=[*history, {"type": "function_call_output", "call_id": call.call_id,
                              "output": result}])

    def chat_prompt(result: str) -> list[int]:
        messages = [{"role": "user", "content": ASK},
                    {"role": "assistant", "content": None, "tool_calls": [{
                        "id": call.call_id, "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments}}]},
                    {"role": "tool", "tool_call_id": call.call_id, "content": result}]
        r = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": messages},
                       timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["tokens"]

    short, long = "18C and sunny", "18C and sunny, with a light wind from the west"
    r = answer(short, tool_choice="none")
    (item,) = r.output
    assert item.type == "message" and r.usage.output_tokens > 0
    # The prompt is chat's, tool message included: same length, and it holds the result.
    ids = chat_prompt(short)
    assert r.usage.input_tokens == len(ids)
    text = httpx.post(f"{tiny_server.base_url}/detokenize", json={"tokens": ids},
                      timeout=30).json()["prompt"]
    assert short in text
    assert answer(long, tool_choice="none").usage.input_tokens == len(chat_prompt(long)) > len(ids)
    # The conversation goes on: another call after the tool's result.
    again = answer(short, tool_choice="required", max_output_tokens=300)
    assert again.status == "completed" and again.output
    for item in again.output:
        _check_call(item, ("get_weather",))
    # function_call_output as input_text parts, and the call sent back as a plain dict.
    parts = client.responses.create(
        model=MODEL, max_output_tokens=3, temperature=0.0,
        input=[history[0], {"type": "function_call", "call_id": call.call_id,
                            "name": call.name, "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": [{"type": "input_text", "text": short}]}])
    assert parts.usage.input_tokens == r.usage.input_tokens


# ------------------------------------------------------------------ refused
@pytest.mark.parametrize("kwargs, words", [
    (dict(tools=[{"type": "web_search"}, WEATHER, {"type": "file_search"}]),
     "tools of type 'web_search', 'file_search' are not supported"),
    (dict(tools=[{"type": "function", "function": {"name": "f"}}]), "chat completions shape"),
    (dict(tools=[{"type": "function", "parameters": {}}]), "tools[0].name"),
    (dict(tools=[{"type": "function", "name": "f", "parameters": "x"}]),
     "tools[0].parameters must be a JSON schema object"),
    (dict(tools=[7]), "tools of type 7 are not supported"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice='sometimes' is invalid"),
    (dict(tools=[WEATHER], tool_choice=5), "tool_choice=5 is not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
     "needs the function's name at the top"),
    (dict(tools=[WEATHER], tool_choice={"type": "web_search_preview"}), "is not supported"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "name": "nope"}), "not in tools"),
    (dict(tools=[WEATHER], tool_choice="auto"), "--enable-auto-tool-choice"),
    (dict(tools=[WEATHER]), "--enable-auto-tool-choice"),  # "auto" is the default
    (dict(tool_choice={"type": "function", "name": "get_weather"}), "needs tools"),
    (dict(input=[{"type": "reasoning", "summary": []}]),
     "input items must be of type 'message', 'function_call' or 'function_call_output'"),
    (dict(input=[{"type": "function_call_output", "call_id": "c",
                  "output": [{"type": "input_image", "image_url": "x"}]}]),
     "content of type 'input_image'"),
])
def test_what_is_not_served_is_a_400_naming_it(client, kwargs, words):
    kwargs = {"input": "hi", **kwargs}
    with pytest.raises(openai.BadRequestError, match=re.escape(words)) as e:
        client.responses.create(model=MODEL, max_output_tokens=2, **kwargs)
    assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"


# ------------------------------------------------------------------ the stream's items
def _kinds(events: list[str]) -> list[tuple[str, int | None]]:
    out = []
    for e in events:
        payload = json.loads(e.split("data: ", 1)[1])
        out.append((payload["type"], payload.get("output_index")))
    return out


def _items():
    seq = iter(range(1000))

    def event(kind, **fields):
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': next(seq), **fields})}\n\n"
    return _StreamItems(event)


def test_text_then_calls_make_a_message_item_then_function_call_items():
    """What tool_choice "auto" streams when the model writes before its calls (the tiny model
    never does): the message is done before the first call is added."""
    s = _items()
    events = s.text_delta("\n") + s.text_delta("Let me check. ")
    events += s.call_delta({"index": 0, "id": "call_a", "type": "function",
                            "function": {"name": "get_time", "arguments": '{"tz": "UTC"}'}})
    events += s.text_delta("\n")  # whitespace between calls: no message item
    events += s.call_delta({"index": 1, "id": "call_b", "type": "function",
                            "function": {"name": "get_weather", "arguments": ""}})
    events += s.call_delta({"index": 1, "function": {"arguments": '{"city": "Paris"'}})
    events += s.call_delta({"index": 1, "function": {"arguments": ', "days": 2}'}})
    events += s.finish("completed")
    assert _kinds(events) == [
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.function_call_arguments.delta", 1),
        ("response.function_call_arguments.done", 1), ("response.output_item.done", 1),
        ("response.output_item.added", 2), ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.delta", 2),
        ("response.function_call_arguments.done", 2), ("response.output_item.done", 2)]
    message, first, second = s.items
    assert isinstance(message, OutputMessage) and message.content[0].text == "\nLet me check. "
    assert isinstance(first, OutputFunctionCall) and first.call_id == "call_a"
    assert isinstance(second, OutputFunctionCall) and second.name == "get_weather"
    assert json.loads(second.arguments) == {"city": "Paris", "days": 2}
    assert first.status == second.status == message.status == "completed"
    # Nothing at all, or whitespace only: one (empty or whitespace) message, as non-streamed.
    s = _items()
    events = s.text_delta(" ") + s.finish("incomplete")
    assert [k for k, _ in _kinds(events)][:3] == ["response.output_item.added",
                                                   "response.content_part.added",
                                                   "response.output_text.delta"]
    (message,) = s.items
    assert message.content[0].text == " " and message.status == "incomplete"


def test_non_streamed_items_leave_out_a_blank_message_before_calls():
    class Msg:
        content = "\n"
        tool_calls = [{"id": "call_a", "type": "function",
                       "function": {"name": "get_time", "arguments": "{}"}}]

    (call,) = _output_items(Msg, "completed")
    assert isinstance(call, OutputFunctionCall) and call.call_id == "call_a"
    Msg.content = "Sure."
    message, call = _output_items(Msg, "completed")
    assert isinstance(message, OutputMessage) and message.content[0].text == "Sure."
    Msg.tool_calls = []
    Msg.content = None
    (message,) = _output_items(Msg, "incomplete")
    assert message.content[0].text == "" and message.status == "incomplete"


# ------------------------------------------------------------------ LangChain
def test_langchain_responses_api_bind_tools(tiny_server):
    lc = pytest.importorskip("langchain_openai")
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = lc.ChatOpenAI(model=MODEL, base_url=f"{tiny_server.base_url}/v1", api_key="x",
                        max_retries=0, use_responses_api=True, temperature=1.0,
                        max_tokens=200)
    named = llm.bind_tools([GetTime], tool_choice="GetTime")
    msg = named.invoke("Time?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetTime" and call["args"]["tz"] in ("UTC", "CET", "PST")
    assert call["id"].startswith("call_")
    chunks = list(named.stream("Time?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    (streamed,) = total.tool_calls
    assert streamed["name"] == "GetTime" and streamed["args"]["tz"] in ("UTC", "CET", "PST")
    msg = llm.bind_tools([GetTime, WEATHER], tool_choice="required",
                         parallel_tool_calls=False).invoke("Time?")
    (call,) = msg.tool_calls
    assert call["name"] in ("GetTime", "get_weather")
    # The tool's result goes back; tool_choice "none" answers in text.
    history = [HumanMessage("Time?"), msg, ToolMessage("12:00", tool_call_id=call["id"])]
    answer = llm.bind_tools([GetTime, WEATHER], tool_choice="none").invoke(history)
    assert answer.text and not answer.tool_calls
