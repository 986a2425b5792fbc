"""gpt-oss's harmony output format, split into thinking and answer as its text streams.

A gpt-oss reply (the prompt ends with ``<|start|>assistant``) is a run of messages, each a
header, ``<|message|>``, a body and ``<|end|>`` (the last one ends at ``<|return|>`` or
``<|call|>``, the model's stop tokens, which are not in the text)::

    <|channel|>analysis<|message|>THINKING<|end|><|start|>assistant<|channel|>final<|message|>ANSWER

The header names the message's channel: ``analysis`` bodies are the reasoning; ``final`` and
``commentary`` bodies (the answer, preambles, a tool call's arguments) are the content. Headers,
markers and the text between messages are never returned. The markers are special tokens, so
the text must be detokenized with them (``skip_special_tokens=False``); a marker split across
deltas is held back until it is known to be one.
"""
from __future__ import annotations

from llmtower.server.reasoning.tags import held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
ENDS = ("<|end|>", "<|return|>", "<|call|>")
HEADER, BODY, BETWEEN = "header", "body", "between"


class HarmonyStreamer:
    """One output's split, fed delta by delta: ``feed`` returns the (reasoning, content) text
    that is certain so far (None for nothing), as ``ReasoningStreamer`` does for ``<think>``."""

    def __init__(self) -> None:
        self.state = HEADER  # the prompt ended with <|start|>assistant: a header comes first
        self.header = ""
        self.channel = ""
        self.pending = ""
        self.tagged = False  # an analysis message began: the model thought, maybe nothing

    def _tags(self) -> tuple[str, ...]:
        if self.state == HEADER:
            return (MESSAGE, *ENDS)
        if self.state == BODY:
            return (*ENDS, START)
        return (START, CHANNEL)

    def feed(self, delta: str, finished: bool = False) -> tuple[str | None, str | None]:
        self.pending += delta
        reasoning: list[str] = []
        content: list[str] = []

        def take(text: str) -> None:
            if self.state == HEADER:
                self.header += text
            elif self.state == BODY and text:
                (reasoning if self.channel == "analysis" else content).append(text)

        while True:
            found = [(i, t) for t in self._tags() if (i := self.pending.find(t)) >= 0]
            if not found:
                break
            i, tag = min(found)
            take(self.pending[:i])
            self.pending = self.pending[i + len(tag):]
            self._on_tag(tag)
        hold = 0 if finished else held_back(self.pending, self._tags())
        take(self.pending[:len(self.pending) - hold])
        self.pending = self.pending[len(self.pending) - hold:]
        return "".join(reasoning) or None, "".join(content) or None

    def _on_tag(self, tag: str) -> None:
        if self.state == HEADER and tag == MESSAGE:
            self.channel = _channel(self.header)
            self.tagged = self.tagged or self.channel == "analysis"
            self.state = BODY
        elif self.state == BETWEEN:  # <|start|>, or a header that left it out
            self.state, self.header = HEADER, tag if tag == CHANNEL else ""
        else:  # a message (or a header the model cut short) ended
            self.state = BETWEEN if tag != START else HEADER
            self.header = ""


def _channel(header: str) -> str:
    """The channel a message header names ('' if none): ``assistant<|channel|>final``,
    ``<|channel|>commentary to=functions.f <|constrain|>json``."""
    if CHANNEL not in header:
        return ""
    words = header.split(CHANNEL, 1)[1].split()
    return words[0] if words else ""

