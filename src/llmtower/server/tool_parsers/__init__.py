"""Tool-call parsers for ``tool_choice="auto"`` (``--tool-call-parser NAME``), and the tool
choice logic shared by the chat endpoint (``tool_choice``)."""
from __future__ import annotations

from llmtower.server.tool_parsers.base import ExtractedToolCalls, ToolCall, ToolParser
from llmtower.server.tool_parsers.hermes import HermesToolParser
from llmtower.server.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    HermesToolParser.name: HermesToolParser,
    Llama3JsonToolParser.name: Llama3JsonToolParser,
}


def get_tool_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}: use one of "
                         f"{', '.join(sorted(TOOL_PARSERS))}") from None


__all__ = ["TOOL_PARSERS", "ExtractedToolCalls", "ToolCall", "ToolParser", "get_tool_parser"]
