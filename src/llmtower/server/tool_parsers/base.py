"""What every tool-call parser shares: the tool call itself, the parse result, and the
interface a parser implements (vLLM's ``ToolParser`` names)."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call_id() -> str:
    """An id in OpenAI's shape: 'call_' + 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call: its id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # stream deltas carry the call's index
            d["index"] = index
        return d


@dataclass
class ExtractedToolCalls:
    """A parsed model output: the tool calls it made and the text around them."""

    tool_calls: list[ToolCall]
    content: str | None

    @property
    def tools_called(self) -> bool:
        return bool(self.tool_calls)


def arguments_text(args: Any) -> str:
    """Arguments as OpenAI sends them: JSON text (a model may write an object or a string)."""
    if isinstance(args, str):
        return args
    return json.dumps(args if args is not None else {}, ensure_ascii=False)


def template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as chat templates expect it: ``function.arguments`` as an object
    (templates write ``arguments | tojson``), left as text if it is not JSON."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except json.JSONDecodeError:
            pass
    return {**call, "function": fn, **({"name": fn.get("name"), "arguments": fn.get("arguments")}
                                       if "name" not in call else {})}


class ToolParser:
    """Owns one model family's tool-call format: finds the calls in a finished output.

    ``start_markers`` are the strings that open a tool call; while streaming, text is sent as
    content until one of them appears, and held back while it could still be one's start."""

    name = ""
    start_markers: tuple[str, ...] = ()

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise NotImplementedError

    def starts_tool_call(self, text: str) -> int:
        """Where the first tool call starts in ``text`` (-1: none yet)."""
        found = [i for i in (text.find(m) for m in self.start_markers) if i >= 0]
        return min(found) if found else -1

    def held_back(self, text: str) -> int:
        """How many trailing characters of ``text`` might begin a start marker."""
        best = 0
        for m in self.start_markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    best = max(best, k)
                    break
        return best
