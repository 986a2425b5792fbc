"""The server as real client libraries' higher-level helpers see it, on the tiny random-weight
Llama (gibberish text: structured outputs force valid content where a helper parses it):
the openai SDK's stream / parse helpers (chat and Responses), pydantic_function_tool, raw
responses and their headers, AsyncOpenAI cancellation, models.retrieve, lists of prompts
with n; LangChain's ChatOpenAI (sync, async, structured output, tools, the Responses API)
and its completions LLM. What is covered elsewhere (plain create, parse of a response_format,
tools through create) is not repeated here."""
from __future__ import annotations

import asyncio
import json
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

from server_args import MODEL


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=8)
    temperature: int = Field(ge=-30, le=45)


class GetTime(BaseModel):
    """The time in a time zone."""

    tz: str = Field(pattern="^(UTC|CET|PST)$")


MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
SAMPLED = dict(temperature=1.0, seed=7, max_tokens=200)
CHOICE = {"guided_choice": ["yes", "no"]}  # a text that ends with finish_reason "stop"


def _engine_state(server) -> tuple[bool, float]:
    """Whether nothing runs, waits or holds KV blocks, and how many requests were aborted."""
    values: dict[str, float] = {}
    aborted = 0.0
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + s.value
            if s.name == "vllm:request_success_total" and \
                    s.labels.get("finished_reason") == "abort":
                aborted += s.value
    load = httpx.get(f"{server.base_url}/load", timeout=30).json()["server_load"]
    idle = (values["vllm:num_requests_running"] == 0 and values["vllm:num_requests_waiting"] == 0
            and values["vllm:kv_cache_usage_perc"] == 0 and load == 0)
    return idle, aborted


def _wait_until_idle_with_aborts(server, aborted_before: float, num: int) -> None:
    """Engine series follow the engine's snapshots: poll until it is idle and counts ``num``
    more aborted requests (requests run to their end would count as finished instead)."""
    deadline = time.monotonic() + 120
    while True:
        idle, aborted = _engine_state(server)
        if idle and aborted - aborted_before >= num:
            return
        assert time.monotonic() < deadline, \
            f"cancelled requests: idle={idle}, {aborted - aborted_before} aborted of {num}"
        time.sleep(0.1)


# ------------------------------------------------------------------ openai: chat helpers
def test_sdk_chat_stream_helper_gives_events_and_a_parsed_final_completion(client):
    with client.chat.completions.stream(model=MODEL, messages=MSG, response_format=Weather,
                                        **SAMPLED) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    kinds = {e.type for e in events}
    assert {"chunk", "content.delta", "content.done"} <= kinds
    deltas = "".join(e.delta for e in events if e.type == "content.delta")
    message = final.choices[0].message
    assert final.choices[0].finish_reason == "stop" and deltas == message.content
    assert isinstance(message.parsed, Weather)
    assert [e.parsed for e in events if e.type == "content.done"] == [message.parsed]
    # Plain text: the helper's final completion holds the streamed text and finish reason.
    with client.chat.completions.stream(model=MODEL, messages=MSG, temperature=1.0,
                                        extra_body=CHOICE) as stream:
        text = "".join(e.delta for e in stream if e.type == "content.delta")
        final = stream.get_final_completion()
    assert text in ("yes", "no") and final.choices[0].message.content == text
    # A length cut is what the SDK refuses to parse, as it would OpenAI's.
    with pytest.raises(openai.LengthFinishReasonError):
        with client.chat.completions.stream(model=MODEL, messages=MSG, max_tokens=3,
                                            temperature=0.0) as stream:
            stream.get_final_completion()


def test_sdk_parse_of_pydantic_function_tools_named_and_required(client):
    tools = [openai.pydantic_function_tool(Weather), openai.pydantic_function_tool(GetTime)]
    r = client.chat.completions.parse(model=MODEL, messages=MSG, tools=tools, **SAMPLED,
                                      tool_choice={"type": "function",
                                                   "function": {"name": "Weather"}})
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name == "Weather"
    assert isinstance(call.function.parsed_arguments, Weather)
    r = client.chat.completions.parse(model=MODEL, messages=MSG, tools=tools, **SAMPLED,
                                      tool_choice="required", parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    expected = {"Weather": Weather, "GetTime": GetTime}[call.function.name]
    assert isinstance(call.function.parsed_arguments, expected)
    assert call.id.startswith("call_")


def test_sdk_stream_helper_parses_streamed_tool_call_arguments(client):
    tools = [openai.pydantic_function_tool(Weather)]
    with client.chat.completions.stream(model=MODEL, messages=MSG, tools=tools, **SAMPLED,
                                        tool_choice={"type": "function",
                                                     "function": {"name": "Weather"}}) as s:
        events = list(s)
        final = s.get_final_completion()
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert len(done) == 1 and done[0].name == "Weather"
    assert isinstance(done[0].parsed_arguments, Weather)
    deltas = "".join(e.arguments_delta for e in events
                     if e.type == "tool_calls.function.arguments.delta")
    (call,) = final.choices[0].message.tool_calls
    assert deltas == call.function.arguments == done[0].arguments
    assert call.function.parsed_arguments == done[0].parsed_arguments


# ------------------------------------------------------------------ openai: Responses API
def test_responses_parse_and_stream_with_a_pydantic_text_format(client):
    r = client.responses.parse(model=MODEL, input="Weather?", text_format=Weather,
                               max_output_tokens=200, temperature=1.0)
    assert r.status == "completed" and isinstance(r.output_parsed, Weather)
    assert r.text.format.type == "json_schema" and r.text.format.name == "Weather"
    with client.responses.stream(model=MODEL, input="Weather?", text_format=Weather,
                                 max_output_tokens=200, temperature=1.0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and isinstance(final.output_parsed, Weather)
    assert final.usage.output_tokens > 0
    obj = client.responses.create(model=MODEL, input="JSON please", max_output_tokens=100,
                                  text={"format": {"type": "json_object"}}, temperature=1.0)
    assert obj.status == "incomplete" or isinstance(json.loads(obj.output_text), dict)


def test_responses_refuse_what_they_would_otherwise_ignore(client):
    for kwargs, words in [
        (dict(text={"format": {"type": "json_schema", "name": "w"}}), "needs its schema"),
        (dict(text={"format": {"type": "yaml"}}), "text.format.type"),
        (dict(tools=[{"type": "web_search"}]), "tools of type 'web_search' are not supported"),
        (dict(tool_choice="required"), "needs tools"),
        (dict(include=["message.output_text.logprobs"]), "include=['message.output_text"),
        (dict(truncation="auto"), "truncation: Input should be 'disabled'"),
    ]:
        with pytest.raises(openai.BadRequestError, match=re.escape(words)) as e:
            client.responses.create(model=MODEL, input="hi", max_output_tokens=2, **kwargs)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
    # What clients send by default without tools is accepted.
    r = client.responses.create(model=MODEL, input="hi", max_output_tokens=2,
                                tool_choice="auto", parallel_tool_calls=True, include=[],
                                truncation="disabled")
    assert r.usage.output_tokens == 2


def test_responses_take_a_previous_answer_back_as_input(client):
    first = client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    second = client.responses.create(
        model=MODEL, max_output_tokens=4,
        input=[{"role": "user", "content": "Hi"}, *[o.model_dump() for o in first.output],
               {"role": "user", "content": "And then?"}])
    assert second.output[0].type == "message" and second.usage.output_tokens == 4
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens


# ------------------------------------------------------------------ openai: plumbing
def test_raw_responses_carry_the_request_id_header(client):
    raw = client.chat.completions.with_raw_response.create(model=MODEL, messages=MSG,
                                                           max_tokens=2)
    completion = raw.parse()
    assert raw.headers["content-type"].startswith("application/json")
    assert raw.request_id == completion.id == completion._request_id
    raw = client.completions.with_raw_response.create(
        model=MODEL, prompt="hi", max_tokens=2, extra_headers={"X-Request-Id": "trace-9"})
    assert raw.request_id == raw.parse().id == "cmpl-trace-9"
    with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=MSG, max_tokens=3, stream=True) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        ids = {json.loads(line[6:])["id"] for line in resp.iter_lines()
               if line.startswith("data: {")}
    assert ids == {resp.request_id}
    raw = client.responses.with_raw_response.create(model=MODEL, input="hi",
                                                    max_output_tokens=2)
    assert raw.request_id and raw.parse().id.startswith("resp_")


def test_async_client_streams_and_a_cancelled_stream_frees_its_request(tiny_server):
    _, aborted_before = _engine_state(tiny_server)

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x",
                                      max_retries=0) as ac:
            got = [asyncio.Event() for _ in range(3)]

            async def consume(i):
                stream = await ac.chat.completions.create(
                    model=MODEL, messages=MSG, max_tokens=480, stream=True,
                    extra_body={"ignore_eos": True, "min_tokens": 480})
                async for chunk in stream:
                    if chunk.choices and chunk.choices[0].delta.content:
                        got[i].set()

            tasks = [asyncio.create_task(consume(i)) for i in range(3)]
            for e in got:
                await e.wait()  # every stream is generating
            assert not any(t.done() for t in tasks)
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            assert all(t.cancelled() for t in tasks)
            # The same client still streams whole answers.
            stream = await ac.chat.completions.create(model=MODEL, messages=MSG, max_tokens=4,
                                                      stream=True, temperature=0.0,
                                                      extra_body={"ignore_eos": True})
            return [c async for c in stream]

    chunks = asyncio.run(main())
    assert chunks[-1].choices[0].finish_reason == "length"
    _wait_until_idle_with_aborts(tiny_server, aborted_before, 3)


def test_async_stream_helpers_parse_chat_and_responses(tiny_server):
    async def main():
        async with openai.AsyncOpenAI(base_url=f"{tiny_server.base_url}/v1", api_key="x",
                                      max_retries=0) as ac:
            async with ac.chat.completions.stream(model=MODEL, messages=MSG,
                                                  response_format=Weather, **SAMPLED) as s:
                kinds = {e.type async for e in s}
                chat = await s.get_final_completion()
            async with ac.responses.stream(model=MODEL, input="Weather?", text_format=Weather,
                                           max_output_tokens=200, temperature=1.0) as s2:
                last = [e.type async for e in s2][-1]
                response = await s2.get_final_response()
            return kinds, chat, last, response

    kinds, chat, last, response = asyncio.run(main())
    assert "content.done" in kinds and isinstance(chat.choices[0].message.parsed, Weather)
    assert last == "response.completed" and isinstance(response.output_parsed, Weather)


def test_models_list_and_retrieve(client, tiny_server):
    (listed,) = client.models.list().data
    card = client.models.retrieve(MODEL)
    assert card.id == listed.id == MODEL and card.object == "model"
    assert card.max_model_len == listed.max_model_len == 512
    with pytest.raises(openai.NotFoundError, match="does not exist") as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"
    r = httpx.get(f"{tiny_server.base_url}/v1/models/org/no-such-model", timeout=30)
    assert r.status_code == 404 and "'org/no-such-model'" in r.json()["error"]["message"]


def test_completions_of_a_list_of_prompts_with_n(client):
    prompts = ["The quick brown fox", "Hello world, I am"]
    kw = dict(model=MODEL, n=2, max_tokens=6, temperature=1.0, seed=5,
              extra_body={"ignore_eos": True})
    both = client.completions.create(prompt=prompts, **kw)
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    # Prompt-major, as OpenAI numbers them: prompt i's samples are i*n .. i*n + n-1.
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [c.text for a in alone for c in a.choices]
    assert both.usage.completion_tokens == 24
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    texts = [""] * 4
    for chunk in client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert texts == [c.text for c in both.choices]


# ------------------------------------------------------------------ LangChain
@pytest.fixture(scope="module")
def chat_model(tiny_server):
    lc = pytest.importorskip("langchain_openai")

    def make(**kw):
        return lc.ChatOpenAI(model=MODEL, base_url=f"{tiny_server.base_url}/v1", api_key="x",
                             max_retries=0, **kw)
    return make


def test_langchain_invoke_stream_and_batch(chat_model):
    llm = chat_model(temperature=0.0, max_tokens=8, stream_usage=True)
    msg = llm.invoke("Hello")
    assert msg.response_metadata["finish_reason"] in ("stop", "length")
    assert msg.usage_metadata["output_tokens"] <= 8 and msg.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream("Hello"))
    assert "".join(c.content for c in chunks) == msg.content
    (usage,) = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert (usage["input_tokens"], usage["output_tokens"]) == (
        msg.usage_metadata["input_tokens"], msg.usage_metadata["output_tokens"])
    batch = llm.batch(["Hello", "Bonjour", "Hello"])
    assert batch[0].content == batch[2].content == msg.content
    assert batch[1].content == llm.invoke("Bonjour").content


def test_langchain_async_stream_and_batch(chat_model):
    llm = chat_model(temperature=0.0, max_tokens=8)
    plain = llm.invoke("Hello").content

    async def main():  # one event loop: LangChain caches its async HTTP client
        streamed = "".join([c.content async for c in llm.astream("Hello")])
        return streamed, await llm.abatch(["Hello", "Hello"])

    streamed, batch = asyncio.run(main())
    assert streamed == plain and [m.content for m in batch] == [plain, plain]


def test_langchain_structured_output_by_json_schema_and_function_calling(chat_model):
    llm = chat_model(temperature=1.0, max_tokens=200, seed=3)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method, include_raw=True).invoke("?")
        assert out["parsing_error"] is None and isinstance(out["parsed"], Weather), method
        if method == "function_calling":
            assert out["raw"].tool_calls[0]["name"] == "Weather"
        *_, last = llm.with_structured_output(Weather, method=method).stream("?")
        assert isinstance(last, Weather), method


def test_langchain_bind_tools_with_tool_choice_and_a_tool_round_trip(chat_model):
    from langchain_core.messages import HumanMessage, ToolMessage

    llm = chat_model(temperature=1.0, max_tokens=300, seed=1)
    names = {"Weather", "GetTime"}
    for choice in ("required", "any"):
        msg = llm.bind_tools([Weather, GetTime], tool_choice=choice).invoke("Weather?")
        assert msg.tool_calls and {c["name"] for c in msg.tool_calls} <= names, choice
        assert msg.response_metadata["finish_reason"] == "tool_calls"
    msg = llm.bind_tools([Weather, GetTime], tool_choice="required",
                         parallel_tool_calls=False).invoke("Weather?")
    assert len(msg.tool_calls) == 1
    named = llm.bind_tools([Weather, GetTime], tool_choice="GetTime")
    msg = named.invoke("Time?")
    (call,) = msg.tool_calls
    assert call["name"] == "GetTime" and call["args"]["tz"] in ("UTC", "CET", "PST")
    chunks = list(named.stream("Time?"))
    total = chunks[0]
    for c in chunks[1:]:
        total = total + c
    assert [c["name"] for c in total.tool_calls] == ["GetTime"]
    history = [HumanMessage("Time?"), msg, ToolMessage("12:00", tool_call_id=call["id"])]
    answer = llm.bind_tools([GetTime], tool_choice="none").invoke(history)
    assert isinstance(answer.content, str) and not answer.tool_calls


def test_langchain_responses_api(chat_model):
    llm = chat_model(use_responses_api=True, temperature=1.0, max_tokens=200)
    parsed = llm.with_structured_output(Weather, method="json_schema").invoke("Weather?")
    assert isinstance(parsed, Weather)
    # Greedy, so the random model's answer is fixed (the Responses API has no ignore_eos).
    msg = chat_model(use_responses_api=True, temperature=0.0, max_tokens=4).invoke("Hi")
    assert msg.response_metadata["status"] == "incomplete"
    assert msg.usage_metadata["output_tokens"] == 4
    # Function calling (test_responses_tools.py has more): a forced call parses.
    out = llm.with_structured_output(Weather, method="function_calling").invoke("Weather?")
    assert isinstance(out, Weather)


def test_langchain_completions_llm(tiny_server):
    lc = pytest.importorskip("langchain_openai")
    kw = dict(model=MODEL, base_url=f"{tiny_server.base_url}/v1", api_key="x", max_retries=0,
              max_tokens=5)
    llm = lc.OpenAI(temperature=0.0, **kw)
    text = llm.invoke("The quick brown fox")
    assert isinstance(text, str)
    assert "".join(llm.stream("The quick brown fox")) == text
    assert llm.batch(["The quick brown fox", "Hello"])[0] == text
    result = lc.OpenAI(temperature=1.0, n=2, logprobs=1, **kw).generate(["a", "b c"])
    assert [len(g) for g in result.generations] == [2, 2]
    for gen in (g for per_prompt in result.generations for g in per_prompt):
        lp = gen.generation_info["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) <= 5
    assert result.llm_output["token_usage"]["completion_tokens"] <= 20
    constrained = lc.OpenAI(temperature=1.0, extra_body=CHOICE, **kw)
    assert constrained.invoke("Yes or no?") in ("yes", "no")
