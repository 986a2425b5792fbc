"""Hermes-style tool calls (Qwen2.5, Hermes, SmolLM2-style templates):
``<tool_call>{"name": "f", "arguments": {...}}</tool_call>``, one or several, maybe after text."""
from __future__ import annotations

import json
import re

from llmtower.server.tool_parsers.base import (ExtractedToolCalls, ToolCall, ToolParser,
                                               arguments_text)

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class HermesToolParser(ToolParser):
    """Owns the ``<tool_call>...</tool_call>`` format."""

    name = "hermes"
    start_markers = ("<tool_call>",)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find("<tool_call>")
        if start < 0:
            return ExtractedToolCalls([], text)
        calls: list[ToolCall] = []
        for body in _CALL.findall(text[start:]):
            try:
                obj = json.loads(body)
            except json.JSONDecodeError:
                return ExtractedToolCalls([], text)  # not a well-formed call: plain text
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCalls([], text)
            calls.append(ToolCall(obj["name"], arguments_text(obj.get("arguments"))))
        content = text[:start].strip() or None
        return ExtractedToolCalls(calls, content)
