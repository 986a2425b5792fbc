"""The openai_gptoss reasoning parser: gpt-oss's harmony messages split into reasoning
(analysis channel) and content (final / commentary), whole and fed a piece at a time, and the
parser a gpt-oss model folder gets without --reasoning-parser."""
from __future__ import annotations

import json

import pytest

from llmtower.server.reasoning import default_reasoning_parser, get_reasoning_parser

A = "<|channel|>analysis<|message|>"
F = "<|start|>assistant<|channel|>final<|message|>"


@pytest.mark.parametrize("text, reasoning, content", [
    (A + "Think.<|end|>" + F + "Answer.", "Think.", "Answer."),
    (A + "Still thin", "Still thin", None),  # cut by max_tokens while thinking
    (A + "<|end|>" + F + "Hi", "", "Hi"),  # an empty thinking block: it thought, nothing
    ("<|channel|>final<|message|>Hi", None, "Hi"),  # no thinking at all
    # A header without <|start|>assistant, a preamble on the commentary channel.
    (A + "a<|end|><|channel|>commentary<|message|>Let me see. <|end|>" + F + "b",
     "a", "Let me see. b"),
    # Two analysis messages; text between messages and a header cut short are dropped.
    (A + "x<|end|>junk" + A + "y<|end|><|start|>assistant<|channel|>fin", "xy", None),
    ("", None, None),
])
def test_harmony_split(text, reasoning, content):
    parser = get_reasoning_parser("openai_gptoss")
    assert parser.needs_special_tokens
    assert parser.extract_reasoning(text) == (reasoning, content)


def test_harmony_streamed_a_character_at_a_time_equals_whole():
    text = A + "Think <hard>.<|end|>" + F + "The answer: <|x|> 42."
    streamer = get_reasoning_parser("openai_gptoss").streamer()
    got = {"reasoning": "", "content": ""}
    for i, ch in enumerate(text):
        reasoning, content = streamer.feed(ch, finished=i == len(text) - 1)
        got["reasoning"] += reasoning or ""
        got["content"] += content or ""
    # No piece of a marker reached the client; text that only looked like one did.
    assert got == {"reasoning": "Think <hard>.", "content": "The answer: <|x|> 42."}


def test_gpt_oss_gets_the_harmony_parser_by_default(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss"}))
    assert default_reasoning_parser(tmp_path) == "openai_gptoss"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert default_reasoning_parser(tmp_path) is None
    assert default_reasoning_parser(tmp_path / "missing") is None
