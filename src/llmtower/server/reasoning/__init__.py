"""Reasoning parsers (``--reasoning-parser NAME``, vLLM's names): split a thinking model's
output into its reasoning (between ``<think>`` and ``</think>``) and the answer that follows.

Chat completions return the reasoning in ``message.reasoning_content`` (and ``reasoning``,
vLLM's newer name) and the rest in ``content``; streamed, deltas carry ``reasoning_content``
until the end tag, then ``content``. The tags themselves are never returned, and a tag split
across deltas is held back until it is known to be one.

- ``deepseek_r1``: the start tag may be absent (the chat template put it in the prompt), so
  all text up to ``</think>`` is reasoning (a ``<think>`` in it is dropped).
- ``qwen3``: reasoning only when ``<think>`` appears (none with ``enable_thinking: false``);
  text before it is content.

- ``openai_gptoss``: gpt-oss's harmony messages (``harmony.py``): ``analysis`` channel
  bodies are reasoning, ``final`` / ``commentary`` bodies content. Its markers are special
  tokens, so a request's text is detokenized with them (``needs_special_tokens``). A gpt-oss
  model gets it without ``--reasoning-parser`` (``default_reasoning_parser``), as vLLM always
  parses gpt-oss replies: without it the content would be the channel names run together
  with the answer.

With no end tag (the answer was cut by max_tokens while thinking) all the text after the
start is reasoning. Only the first thinking block counts: after ``</think>`` all is content.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from llmtower.server.reasoning.harmony import HarmonyStreamer
from llmtower.server.reasoning.tags import held_back

START, END = "<think>", "</think>"
BEFORE, REASONING, AFTER = "before", "reasoning", "after"


class ReasoningStreamer:
    """One output's split, fed delta by delta: ``feed`` returns the (reasoning, content) text
    that is certain so far (None for nothing), holding back a tail that may begin a tag."""

    def __init__(self, start_optional: bool) -> None:
        self.start_optional = start_optional
        self.state = REASONING if start_optional else BEFORE
        self.start_seen = False
        self.pending = ""
        self.tagged = False  # a tag was seen: the model thought, maybe nothing

    def _tags(self) -> tuple[str, ...]:
        if self.state == BEFORE:
            return (START,)
        if self.state == REASONING:
            return (END,) if self.start_seen else (START, END)
        return ()

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]:
        self.pending += delta
        reasoning: list[str] = []
        content: list[str] = []

        def emit(text: str) -> None:
            if text:
                (reasoning if self.state == REASONING else content).append(text)

        while True:
            tags = self._tags()
            found = [(i, t) for t in tags if (i := self.pending.find(t)) >= 0]
            if not found:
                break
            i, tag = min(found)
            emit(self.pending[:i])
            self.pending = self.pending[i + len(tag):]
            if tag == START:
                self.start_seen, self.state = True, REASONING
            else:
                self.state = AFTER
            self.tagged = True
        hold = 0 if finished else held_back(self.pending, self._tags())
        emit(self.pending[:len(self.pending) - hold])
        self.pending = self.pending[len(self.pending) - hold:]
        return "".join(reasoning) or None, "".join(content) or None


class Streamer(Protocol):
    """What the chat endpoint feeds an output's text to, delta by delta."""

    tagged: bool

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]: ...


class ReasoningParser:
    """A model family's thinking format (vLLM's ``ReasoningParser`` role)."""

    name = ""
    start_optional = False
    # The format's markers are special tokens: the text must be detokenized with them.
    needs_special_tokens = False

    def streamer(self) -> Streamer:
        return ReasoningStreamer(self.start_optional)

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        """A finished output's (reasoning, content): reasoning is None when the model did not
        think ("" for an empty thinking block), content None when nothing follows."""
        s = self.streamer()
        reasoning, content = s.feed(text, finished=True)
        if reasoning is None and s.tagged:
            reasoning = ""
        return reasoning, content


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"
    start_optional = True


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"


class GptOssReasoningParser(ReasoningParser):
    name = "openai_gptoss"
    needs_special_tokens = True

    def streamer(self) -> Streamer:
        return HarmonyStreamer()


REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    DeepSeekR1ReasoningParser.name: DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser.name: Qwen3ReasoningParser,
    GptOssReasoningParser.name: GptOssReasoningParser,
}
# config.json model_type -> the parser its replies need even without --reasoning-parser.
_MODEL_TYPE_PARSERS = {"gpt_oss": GptOssReasoningParser.name}


def default_reasoning_parser(model_path: str | Path) -> str | None:
    """The parser a model's own output format needs (None for most): gpt-oss's harmony."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return _MODEL_TYPE_PARSERS.get(model_type)


def get_reasoning_parser(name: str) -> ReasoningParser:
    try:
        return REASONING_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of "
                         f"{', '.join(sorted(REASONING_PARSERS))}") from None


__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStreamer", "Streamer",
           "default_reasoning_parser", "get_reasoning_parser"]
