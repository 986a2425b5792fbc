"""The chunks streamed without pydantic are byte for byte those of the pydantic models."""
from __future__ import annotations

import pytest

from llmtower.server.protocol_chat import ChatCompletionChunk, ChatStreamChoice, DeltaMessage
from llmtower.server.protocol_completions import CompletionChoice, CompletionChunk
from llmtower.server.serving_base import sse
from llmtower.server.stream_chunks import StreamChunkEncoder, chat_choice, completion_choice

CASES = [("plain", None, None), ("", "length", None), ("end", "stop", "</s>"),
         ("é 😀 \"q\"\n\\", "stop", 7), ("x", None, None)]


@pytest.mark.parametrize("text, finish, stop", CASES)
def test_completion_chunks_match_the_pydantic_model(text, finish, stop):
    enc = StreamChunkEncoder("text_completion", "cmpl-1", 1700000000, "tiny/é")
    want = CompletionChunk(id="cmpl-1", created=1700000000, model="tiny/é", choices=[
        CompletionChoice(index=3, text=text, finish_reason=finish, stop_reason=stop)])
    got = enc.event(completion_choice(3, text, finish, stop))
    assert got == sse(want.model_dump_json(exclude_none=True)).encode()


@pytest.mark.parametrize("text, finish, stop", [*CASES, (None, "stop", None)])
def test_chat_chunks_match_the_pydantic_model(text, finish, stop):
    enc = StreamChunkEncoder("chat.completion.chunk", "chatcmpl-1", 1700000000, "m")
    want = ChatCompletionChunk(id="chatcmpl-1", created=1700000000, model="m", choices=[
        ChatStreamChoice(index=0, delta=DeltaMessage(content=text), finish_reason=finish,
                         stop_reason=stop)])
    got = enc.event(chat_choice(0, text, finish, stop))
    assert got == sse(want.model_dump_json(exclude_none=True)).encode()
