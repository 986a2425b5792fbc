"""--reasoning-parser (deepseek_r1, qwen3): the thinking between <think> and </think> in
``reasoning_content`` (and ``reasoning``), the rest in ``content``; streamed, the deltas carry
reasoning until the end tag, then content, with no tag leaking even when split across deltas.

The parser is proven on real text first: whole outputs and every way of cutting them into
deltas. Then through servers started with the flag, on the tiny random-weight model. It writes
gibberish, so the tags come from where a real deployment also has them: an assistant prefill
(``continue_final_message`` + ``echo``, the reply continuing the client's "<think>..." text), or
no end tag at all (deepseek_r1: the thinking is cut off by max_tokens). The same greedy
request to the shared server without the flag shows that the split loses and adds nothing."""
from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import openai
import pytest

from llmtower.server.reasoning import REASONING_PARSERS, get_reasoning_parser
from server_args import MODEL, TINY_SERVER_ARGS, start_servers

# The <think> parsers (gpt-oss's harmony one: test_reasoning_harmony.py).
PARSERS = sorted(n for n in REASONING_PARSERS if not REASONING_PARSERS[n].needs_special_tokens)

# (text, {parser: (reasoning, content)})
SAMPLES = [
    ("<think>Let me add 2 and 2.\nThat is 4.</think>\n\nThe answer is 4.",
     {"deepseek_r1": ("Let me add 2 and 2.\nThat is 4.", "\n\nThe answer is 4."),
      "qwen3": ("Let me add 2 and 2.\nThat is 4.", "\n\nThe answer is 4.")}),
    # The template put <think> in the prompt: only the end tag is in the output.
    ("The user greets me.</think>Hello!",
     {"deepseek_r1": ("The user greets me.", "Hello!"),
      "qwen3": (None, "The user greets me.</think>Hello!")}),
    # Cut by max_tokens while thinking: all of it is reasoning.
    ("<think>First, the capital of France is",
     {"deepseek_r1": ("First, the capital of France is", None),
      "qwen3": ("First, the capital of France is", None)}),
    ("<think>cut right in the end tag </thi",
     {"deepseek_r1": ("cut right in the end tag </thi", None),
      "qwen3": ("cut right in the end tag </thi", None)}),
    # No tags (qwen3 with enable_thinking false): content; deepseek_r1 thinks until </think>.
    ("Paris is the capital of France.",
     {"deepseek_r1": ("Paris is the capital of France.", None),
      "qwen3": (None, "Paris is the capital of France.")}),
    # Text before <think>.
    ("Sure. <think>plan: be brief</think>Done.",
     {"deepseek_r1": ("Sure. plan: be brief", "Done."),
      "qwen3": ("plan: be brief", "Sure. Done.")}),
    # Empty reasoning.
    ("<think></think>Just the answer.",
     {"deepseek_r1": ("", "Just the answer."), "qwen3": ("", "Just the answer.")}),
    # Almost-tags are text; after the first block everything is content, tags included.
    ("<think>a <thin b < / think></think>x <think>y</think>",
     {"deepseek_r1": ("a <thin b < / think>", "x <think>y</think>"),
      "qwen3": ("a <thin b < / think>", "x <think>y</think>")}),
    ("1 < 2 and <t", {"deepseek_r1": ("1 < 2 and <t", None), "qwen3": (None, "1 < 2 and <t")}),
    ("", {"deepseek_r1": (None, None), "qwen3": (None, None)}),
]
CASES = [(name, text, want[name]) for text, want in SAMPLES for name in PARSERS]


def _stream(name: str, pieces: list[str]) -> tuple[list[str], list[str]]:
    """The reasoning and content deltas of ``pieces`` fed one by one (the last one finishes)."""
    s = get_reasoning_parser(name).streamer()
    reasoning, content = [], []
    for k, piece in enumerate(pieces):
        r, c = s.feed(piece, finished=k == len(pieces) - 1)
        reasoning += [r] if r is not None else []
        content += [c] if c is not None else []
    return reasoning, content


def _joined(want: str | None) -> str:
    return want or ""


# ------------------------------------------------------------------ the parser on text
@pytest.mark.parametrize("name,text,want", CASES)
def test_a_finished_output_is_split(name, text, want):
    assert get_reasoning_parser(name).extract_reasoning(text) == want


@pytest.mark.parametrize("name,text,want", CASES)
def test_every_split_point_streams_the_same_split(name, text, want):
    for i in range(len(text) + 1):
        reasoning, content = _stream(name, [text[:i], text[i:]])
        assert ("".join(reasoning), "".join(content)) == tuple(map(_joined, want)), i


@pytest.mark.parametrize("name,text,want", CASES)
def test_every_pair_of_split_points_and_one_character_deltas(name, text, want):
    splits = [[text[:i], text[i:j], text[j:]] for i in range(len(text) + 1)
              for j in range(i, len(text) + 1)]
    splits.append(list(text) or [""])
    for pieces in splits:
        reasoning, content = _stream(name, pieces)
        assert ("".join(reasoning), "".join(content)) == tuple(map(_joined, want)), pieces


@pytest.mark.parametrize("name", PARSERS)
def test_tags_split_across_deltas_never_leak(name):
    text = "<think>Two plus two is four.</think>It is 4."
    for pieces in ([text[:i], text[i:j], text[j:]] for i in range(len(text))
                   for j in range(i, len(text))):
        reasoning, content = _stream(name, pieces)
        for piece in reasoning + content:
            assert "<" not in piece and ">" not in piece, pieces
        assert "".join(reasoning) == "Two plus two is four." and "".join(content) == "It is 4."


def test_a_partial_tag_is_held_back_until_it_is_known_not_to_be_one():
    s = get_reasoning_parser("qwen3").streamer()
    assert s.feed("a <thi") == (None, "a ")  # "<thi" may be <think>
    assert s.feed("rd") == (None, "<third")  # it was not
    assert s.feed("<thi") == (None, None)
    assert s.feed("nk>x</th") == ("x", None)
    assert s.feed("", finished=True) == ("</th", None)  # the end came with no end tag


def test_an_unknown_name_lists_the_choices():
    with pytest.raises(ValueError, match="'nope'.*deepseek_r1, openai_gptoss, qwen3"):
        get_reasoning_parser("nope")
    from llmtower.server.api_server import ServerSettings
    with pytest.raises(ValueError, match="deepseek_r1, openai_gptoss, qwen3"):
        ServerSettings(reasoning_parser="nope")


def test_serve_refuses_an_unknown_parser_at_startup(capsys):
    from llmtower.cli.main import main
    with pytest.raises(SystemExit) as exit_:  # `llmtower serve` exits 2, as argparse does
        main(["serve", "--reasoning-parser", "nope"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--reasoning-parser" in err and "'deepseek_r1'" in err
    assert "'qwen3'" in err and "'openai_gptoss'" in err


# ------------------------------------------------------------------ Responses stream (no model)
def _sdk_events(chat_deltas: list[dict], finish: str = "stop") -> list:
    """/v1/responses' stream events for these chat deltas, validated as the SDK's types."""
    import asyncio

    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    from llmtower.server.protocol_responses import ResponsesRequest
    from llmtower.server.serving_responses import OpenAIServingResponses

    chunks = [f"data: {json.dumps({'choices': [{'index': 0, 'delta': d}]})}\n\n"
              for d in chat_deltas]
    chunks.append(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {}, 'finish_reason': finish}]})}\n\n")

    async def source():
        for c in chunks:
            yield c

    async def run():
        responses = OpenAIServingResponses(SimpleNamespace(model_name="m"))
        req = ResponsesRequest(model="m", input="hi", stream=True)
        return [e async for e in responses._stream(req, source())]

    adapter = TypeAdapter(ResponseStreamEvent)
    return [adapter.validate_python(json.loads(e.split("data: ", 1)[1]))
            for e in asyncio.run(run())]


def test_responses_stream_a_reasoning_item_before_the_message():
    reasoning, content = _stream("qwen3", ["<think>Two and", " two</th", "ink>\n\nFo", "ur."])
    deltas = ([{"reasoning_content": r} for r in reasoning]
              + [{"content": c} for c in content])
    events = _sdk_events(deltas)
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress",
                         "response.output_item.added"]
    assert events[2].item.type == "reasoning" and events[2].output_index == 0
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == "Two and two"
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [d.item.type for d in done] == ["reasoning", "message"]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    assert [e.output_index for e in events if e.type == "response.output_text.delta"] == [1] * 2
    final = events[-1].response
    assert final.status == "completed"
    assert final.output[0].content[0].text == "Two and two" and final.output_text == "\n\nFour."
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_stream_cut_while_thinking_is_incomplete_reasoning_and_an_empty_message():
    events = _sdk_events([{"reasoning_content": "Hmm, let"}, {"reasoning_content": " me"}],
                         finish="length")
    final = events[-1].response
    assert events[-1].type == "response.incomplete"
    assert [i.type for i in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Hmm, let me" and final.output_text == ""


# ------------------------------------------------------------------ served
@pytest.fixture(scope="module")
def reasoning_servers(tmp_path_factory, tiny_llama_dir):
    """Both parsers' servers, started side by side."""
    servers = start_servers(tmp_path_factory, {
        "r1_server": ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                      "--reasoning-parser", "deepseek_r1", "--enable-auto-tool-choice",
                      "--tool-call-parser", "hermes"],
        "qwen3_server": ["--model", str(tiny_llama_dir), *TINY_SERVER_ARGS,
                         "--reasoning-parser", "qwen3"]})
    yield servers
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="module")
def r1_server(reasoning_servers):
    return reasoning_servers["r1_server"]


@pytest.fixture(scope="module")
def qwen3_server(reasoning_servers):
    return reasoning_servers["qwen3_server"]


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


ASK = [{"role": "user", "content": "What is 2 + 2?"}]
GREEDY = dict(model=MODEL, temperature=0.0, max_tokens=8)


def _prefilled(thought: str) -> dict:
    """The reply continues the client's assistant text, which is echoed in front of it."""
    return dict(messages=[*ASK, {"role": "assistant", "content": thought}],
                extra_body={"continue_final_message": True, "add_generation_prompt": False,
                            "echo": True}, **GREEDY)


def _plain(client) -> str:
    """The greedy reply from the server without a reasoning parser: the same model."""
    return client.chat.completions.create(messages=ASK, **GREEDY).choices[0].message.content


def test_without_the_flag_nothing_changes(client, tiny_server):
    body = dict(messages=ASK, **GREEDY)
    raw = httpx.post(f"{tiny_server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    message = raw["choices"][0]["message"]
    assert "reasoning_content" not in message and "reasoning" not in message
    thought = "<think>plan</think>"
    reply = client.chat.completions.create(**_prefilled(thought)).choices[0].message
    assert reply.content.startswith(thought)


def test_r1_an_answer_with_no_end_tag_is_all_reasoning(client, r1_server):
    text = _plain(client)
    r = _client(r1_server).chat.completions.create(messages=ASK, **GREEDY)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "length"
    assert message.content is None and text
    assert message.reasoning_content == message.reasoning == text


def test_r1_the_thinking_and_the_answer_are_split(client, r1_server):
    thought = "I should add.</think>"  # the start tag was in the prompt
    tail = client.chat.completions.create(**_prefilled(thought)).choices[0].message.content
    tail = tail[len(thought):]
    assert tail  # the model wrote something after the prefill
    message = _client(r1_server).chat.completions.create(**_prefilled(thought)).choices[0].message
    assert message.reasoning_content == message.reasoning == "I should add."
    assert message.content == tail and "</think>" not in message.content


def _thought(delta) -> str | None:
    """A stream delta's reasoning (the SDK keeps fields it does not know as extras)."""
    return getattr(delta, "reasoning_content", None)


def test_r1_streamed_deltas_carry_reasoning_then_content(client, r1_server):
    thought = "<think>Two and two</think>"
    tail = client.chat.completions.create(**_prefilled(thought)).choices[0].message.content
    tail = tail[len(thought):]
    assert tail
    chunks = list(_client(r1_server).chat.completions.create(stream=True, **_prefilled(thought)))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    reasoning = [_thought(d) for d in deltas if _thought(d)]
    content = [d.content for d in deltas if d.content]
    assert "".join(reasoning) == "Two and two" and "".join(content) == tail
    assert not any("think>" in piece for piece in reasoning + content)
    seen_content = False
    for d in deltas:  # no reasoning after the content started
        seen_content = seen_content or bool(d.content)
        assert not (seen_content and _thought(d))
    # Cut off while thinking: every delta is reasoning, and it is the plain reply.
    text = _plain(client)
    chunks = list(_client(r1_server).chat.completions.create(messages=ASK, stream=True,
                                                              **GREEDY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(_thought(d) or "" for d in deltas) == text
    assert not any(d.content for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_r1_tool_calls_are_parsed_in_the_content_only(r1_server):
    tools = [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>'
    client = _client(r1_server)
    kw = _prefilled(f"I will call add.</think>{call}")
    r = client.chat.completions.create(tools=tools, **{**kw, "max_tokens": 1})
    message = r.choices[0].message
    assert message.reasoning_content == "I will call add."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("add", {"a": 2, "b": 2})]
    # A call written while thinking is thinking, not a call.
    r = client.chat.completions.create(tools=tools, **{**_prefilled(f"maybe {call}?"),
                                                       "max_tokens": 1})
    message = r.choices[0].message
    assert not message.tool_calls and message.reasoning_content.startswith(f"maybe {call}?")


def test_r1_structured_output_is_all_content(r1_server):
    r = _client(r1_server).chat.completions.create(messages=ASK, model=MODEL, max_tokens=5,
                                                   extra_body={"guided_choice": ["yes", "no"]})
    message = r.choices[0].message
    assert message.content in ("yes", "no")
    assert getattr(message, "reasoning_content", None) is None


def test_r1_responses_put_the_reasoning_item_first(client, r1_server):
    text = _plain(client)
    sdk = _client(r1_server)
    r = sdk.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0.0,
                             max_output_tokens=8)
    assert r.status == "incomplete" and [i.type for i in r.output] == ["reasoning", "message"]
    assert r.output[0].content[0].text == text and r.output_text == ""
    events = list(sdk.responses.create(model=MODEL, input=ASK[0]["content"], temperature=0.0,
                                       max_output_tokens=8, stream=True))
    assert "".join(e.delta for e in events
                   if e.type == "response.reasoning_text.delta") == text
    final = events[-1].response
    assert final.output[0].type == "reasoning" and final.output[0].content[0].text == text


def test_qwen3_reasons_only_after_the_start_tag(client, qwen3_server):
    text = _plain(client)
    sdk = _client(qwen3_server)
    for extra in ({}, {"chat_template_kwargs": {"enable_thinking": False}}):
        message = sdk.chat.completions.create(messages=ASK, extra_body=extra,
                                              **GREEDY).choices[0].message
        assert message.content == text and getattr(message, "reasoning_content", None) is None
    thought = "<think>Two and two</think>"
    tail = client.chat.completions.create(**_prefilled(thought)).choices[0].message.content
    message = sdk.chat.completions.create(**_prefilled(thought)).choices[0].message
    assert message.reasoning_content == "Two and two"
    assert message.content == tail[len(thought):]
