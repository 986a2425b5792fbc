"""Tool-call parsers (hermes, llama3_json), tool_choice plans and the streaming of tool calls,
without a server."""
from __future__ import annotations

import json

import pytest

from llmtower.server.protocol_chat import ChatCompletionRequest
from llmtower.server.tool_parsers import get_tool_parser
from llmtower.server.tool_parsers.tool_choice import (ToolCallStreamer, ToolSettings,
                                                      plan_tools)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"type": "string"}}, "required": ["tz"]}}}
AUTO = ToolSettings(enable_auto_tool_choice=True, tool_call_parser="hermes")


def test_hermes_parses_calls_and_content():
    p = get_tool_parser("hermes")
    out = p.extract_tool_calls('Let me check.\n<tool_call>\n{"name": "get_weather", '
                               '"arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>'
                               '{"name": "get_time", "arguments": {"tz": "CET"}}</tool_call>')
    assert out.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert all(c.id.startswith("call_") for c in out.tool_calls)
    assert out.tool_calls[0].id != out.tool_calls[1].id
    assert not p.extract_tool_calls("no tools here").tools_called
    assert not p.extract_tool_calls("<tool_call>{not json</tool_call>").tools_called


def test_llama3_json_parses_one_or_several_calls():
    p = get_tool_parser("llama3_json")
    out = p.extract_tool_calls('<|python_tag|>{"name": "get_weather", "parameters": '
                               '{"city": "Oslo"}}; {"name": "get_time", "parameters": {"tz": "UTC"}}')
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [
        ("get_weather", {"city": "Oslo"}), ("get_time", {"tz": "UTC"})]
    assert out.content is None
    assert p.extract_tool_calls("The answer is {not a call}").content == \
        "The answer is {not a call}"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_tool_parser("mistral-ish")


def test_plans_and_their_constraints():
    named = plan_tools([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}},
                       None, ToolSettings())
    assert named.mode == "named" and json.loads(named.structured_outputs().spec) == \
        TIME["function"]["parameters"]
    required = plan_tools([WEATHER, TIME], "required", False, ToolSettings())
    schema = json.loads(required.structured_outputs().spec)
    assert schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    calls = required.extract('[{"name": "get_weather", "parameters": {"city": "Rome"}}]')
    assert calls.tool_calls[0].name == "get_weather"
    none = plan_tools([WEATHER], "none", None, ToolSettings())
    assert none.structured_outputs() is None and none.template_tools() is None
    assert plan_tools([WEATHER], None, None, AUTO).mode == "auto"  # the default with tools


@pytest.mark.parametrize("tools,choice,message", [
    ([WEATHER], "auto", "--enable-auto-tool-choice"),
    ([WEATHER], None, "--enable-auto-tool-choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "not in tools"),
    (None, "required", "needs tools"),
    ([{"type": "retrieval"}], "required", r"tools\[0\] must be"),
    ([WEATHER], "sometimes", "is invalid"),
])
def test_bad_tool_requests_are_value_errors(tools, choice, message):
    with pytest.raises(ValueError, match=message):
        plan_tools(tools, choice, None, ToolSettings())


def test_streaming_named_call_sends_the_call_then_argument_deltas():
    s = ToolCallStreamer(plan_tools([WEATHER], {"type": "function", "function": {
        "name": "get_weather"}}, None, ToolSettings()))
    content, calls = s.feed('{"city": ', False)
    assert content is None and calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["id"].startswith("call_") and calls[1]["function"]["arguments"] == '{"city": '
    _, calls = s.feed('"Paris"}', True)
    assert calls == [{"index": 0, "function": {"arguments": '"Paris"}'}}] and s.called


def test_streaming_auto_holds_back_a_marker_and_sends_calls_at_the_end():
    s = ToolCallStreamer(plan_tools([WEATHER], "auto", None, AUTO))
    out = [s.feed(d, False) for d in ["Sure", ", one moment <tool", "_call>{\"name\": ",
                                      "\"get_weather\", \"arguments\": {\"city\": \"Rome\"}}"]]
    last = s.feed("</tool_call>", True)
    content = "".join(c or "" for c, _ in out + [last])
    assert content == "Sure, one moment "  # the marker never leaks as text
    assert [c["function"]["name"] for c in last[1]] == ["get_weather"] and s.called
    plain = ToolCallStreamer(plan_tools([WEATHER], "auto", None, AUTO))
    assert plain.feed("just text <", False) == ("just text ", None)
    assert plain.feed("3", True) == ("<3", None) and not plain.called


def test_tool_messages_reach_the_template():
    from jinja2 import Template
    req = ChatCompletionRequest(messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}])
    template = Template(
        "{% for m in messages %}[{{ m.role }}]{% if m.tool_calls %}{% for c in m.tool_calls %}"
        "{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endif %}"
        "{% if m.tool_call_id %}<{{ m.tool_call_id }}>{% endif %}{{ m.content }}{% endfor %}")
    assert template.render(messages=[m.for_template() for m in req.messages]) == \
        "[user]Weather in Paris?[assistant]get_weather(Paris)[tool]<call_1>18C, sunny"
