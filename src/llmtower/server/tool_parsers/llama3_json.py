"""Llama 3.x JSON tool calls: the output is ``{"name": "f", "parameters": {...}}`` (optionally
after ``<|python_tag|>``), several separated by ``;``."""
from __future__ import annotations

import json

from llmtower.server.tool_parsers.base import (ExtractedToolCalls, ToolCall, ToolParser,
                                               arguments_text)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Owns the Llama 3 JSON format; text that is not such JSON is plain content."""

    name = "llama3_json"
    start_markers = (PYTHON_TAG, "{")

    def starts_tool_call(self, text: str) -> int:
        # Only a call at the very start of the output (after whitespace) is one.
        stripped = text.lstrip()
        if stripped.startswith((PYTHON_TAG, "{")):
            return len(text) - len(stripped)
        return -1

    def held_back(self, text: str) -> int:
        stripped = text.lstrip()
        if not stripped or PYTHON_TAG.startswith(stripped):
            return len(text)  # could still become a call
        return 0

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        body = text.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG):].strip()
        if not body.startswith("{"):
            return ExtractedToolCalls([], text)
        calls: list[ToolCall] = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except json.JSONDecodeError:
                return ExtractedToolCalls([], text)
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return ExtractedToolCalls([], text)
            args = obj.get("parameters", obj.get("arguments"))
            calls.append(ToolCall(obj["name"], arguments_text(args)))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return ExtractedToolCalls(calls, None)
