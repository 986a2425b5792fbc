"""``tools`` + ``tool_choice`` of one chat request: what to constrain, what the template
sees, and how the output becomes ``tool_calls`` (whole, or as stream deltas).

- ``none``: tools are left out; plain text.
- a named function: the output is constrained to that function's argument schema, so the
  call always parses; it is the call's ``arguments``.
- ``required``: the output is constrained to a JSON array of ``{"name", "parameters"}``
  objects, one of the tools each (at most one unless ``parallel_tool_calls``), as vLLM does.
- ``auto``: unconstrained; ``--tool-call-parser`` finds calls in the text. Needs
  ``--enable-auto-tool-choice`` (vLLM's flags). The default when tools are given.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from llmtower.server.tool_parsers import get_tool_parser
from llmtower.server.tool_parsers.base import (ExtractedToolCalls, ToolCall, ToolParser,
                                               arguments_text)
from llmtower.structured_output.backend_xgrammar import validate
from llmtower.structured_output.params import StructuredOutputsParams

EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass
class ToolSettings:
    """The server's tool-calling flags: ``--enable-auto-tool-choice``, ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes or "
                             "llama3_json)")
        if self.tool_call_parser:
            get_tool_parser(self.tool_call_parser)  # an unknown name fails at start-up


@dataclass
class ToolPlan:
    """How one request uses its tools (see the module docstring)."""

    mode: str  # "none" | "auto" | "required" | "named"
    functions: list[dict[str, Any]]
    name: str | None = None
    parallel: bool = True
    parser: ToolParser | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools the chat template renders (none for ``tool_choice="none"``)."""
        if self.mode == "none" or not self.functions:
            return None
        return [{"type": "function", "function": f} for f in self.functions]

    def structured_outputs(self) -> StructuredOutputsParams | None:
        if self.mode == "named":
            fn = next(f for f in self.functions if f["name"] == self.name)
            params = StructuredOutputsParams(json=fn.get("parameters") or EMPTY_PARAMETERS)
        elif self.mode == "required":
            item = {"type": "object", "anyOf": [
                {"properties": {"name": {"type": "string", "enum": [f["name"]]},
                                "parameters": f.get("parameters") or EMPTY_PARAMETERS},
                 "required": ["name", "parameters"]} for f in self.functions]}
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": item}
            if not self.parallel:
                schema["maxItems"] = 1
            params = StructuredOutputsParams(json=schema)
        else:
            return None
        try:
            validate(params)
        except ValueError as e:
            raise ValueError(f"tools: a function's parameters schema cannot be enforced: {e}") \
                from None
        return params

    def extract(self, text: str) -> ExtractedToolCalls:
        """The finished output of one choice as tool calls and content."""
        if self.mode == "named":
            assert self.name is not None
            return ExtractedToolCalls([ToolCall(self.name, text)], None)
        if self.mode == "required":
            try:
                calls = json.loads(text)
                return ExtractedToolCalls([ToolCall(c["name"], arguments_text(c["parameters"]))
                                           for c in calls], None)
            except (json.JSONDecodeError, KeyError, TypeError):
                return ExtractedToolCalls([], text)  # cut by max_tokens: not a call
        if self.mode == "auto" and self.parser is not None:
            return self.parser.extract_tool_calls(text)
        return ExtractedToolCalls([], text)


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None, settings: ToolSettings) -> ToolPlan:
    """Validate ``tools`` and ``tool_choice`` (ValueError = HTTP 400) and make the plan."""
    functions = [_function(i, t) for i, t in enumerate(tools or [])]
    parallel = parallel_tool_calls is not False
    if tool_choice is None:
        tool_choice = "auto" if functions else "none"
    if tool_choice == "none":
        return ToolPlan("none", functions, parallel=parallel)
    if not functions:
        raise ValueError(f"tool_choice={tool_choice!r} needs tools; send tools or leave "
                         "tool_choice out")
    if tool_choice == "required":
        return ToolPlan("required", functions, parallel=parallel)
    if tool_choice == "auto":
        if not (settings.enable_auto_tool_choice and settings.tool_call_parser):
            raise ValueError("tool_choice=\"auto\" (the default when tools are sent) needs the "
                             "server started with --enable-auto-tool-choice --tool-call-parser "
                             "NAME; or send tool_choice \"required\", \"none\" or a named "
                             "function")
        return ToolPlan("auto", functions, parallel=parallel,
                        parser=get_tool_parser(settings.tool_call_parser))
    if isinstance(tool_choice, dict):
        name = (tool_choice.get("function") or {}).get("name")
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise ValueError("tool_choice must be \"none\", \"auto\", \"required\" or "
                             "{\"type\": \"function\", \"function\": {\"name\": \"...\"}}")
        if name not in {f["name"] for f in functions}:
            raise ValueError(f"tool_choice names the function {name!r}, which is not in tools "
                             f"({', '.join(f['name'] for f in functions)})")
        return ToolPlan("named", functions, name=name, parallel=parallel)
    raise ValueError(f"tool_choice={tool_choice!r} is invalid: use \"none\", \"auto\", "
                     "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}")


def constrain_to_tools(params: Any, plan: ToolPlan) -> Any:
    """``params`` with the plan's constraint (required / named function); asking for another
    structured output at the same time is a ValueError."""
    constraint = plan.structured_outputs()
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise ValueError(f"tool_choice={'required' if plan.mode == 'required' else 'a function'}"
                         " constrains the output to the tools' arguments: do not also send "
                         "response_format, structured_outputs or guided_* fields")
    return dataclasses.replace(params, structured_outputs=constraint)


def tool_finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason of a choice that called tools: "tool_calls" (not "stop")."""
    return "tool_calls" if called and reason == "stop" else reason


def _function(i: int, tool: Any) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("function"), dict):
        raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                         "{\"name\": ..., \"parameters\": {...}}}")
    fn = tool["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(f"tools[{i}].function.name must be a non-empty string")
    params = fn.get("parameters")
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"tools[{i}].function.parameters must be a JSON schema object")
    return {k: v for k, v in fn.items() if k in ("name", "description", "parameters", "strict")}


class ToolCallStreamer:
    """Turns one choice's text deltas into OpenAI stream deltas: content and/or tool calls.

    Named function: the call (id, name) goes first, then the arguments as they come. Required
    and auto: calls are sent whole once the output is complete (auto streams the text before
    the first call marker as content, holding back what might begin a marker)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.in_call = False
        self.called = False
        self._named_id: ToolCall | None = None

    def feed(self, delta: str, finished: bool) -> tuple[str | None, list[dict[str, Any]] | None]:
        plan = self.plan
        self.text += delta
        if plan.mode == "none":
            return (delta or None), None
        if plan.mode == "named":
            calls = []
            if self._named_id is None:
                assert plan.name is not None
                self._named_id = ToolCall(plan.name, "")
                calls.append(self._named_id.to_openai(0))
                self.called = True
            if delta:
                calls.append({"index": 0, "function": {"arguments": delta}})
            return None, calls or None
        if plan.mode == "auto" and not self.in_call:
            assert plan.parser is not None
            start = plan.parser.starts_tool_call(self.text)
            if start < 0:
                upto = len(self.text) if finished else len(self.text) - plan.parser.held_back(
                    self.text)
                out = self.text[self.sent:upto]
                self.sent = max(self.sent, upto)
                return out or None, None
            self.in_call = True
            out = self.text[self.sent:start]
            self.sent = start
            if not finished:
                return out or None, None
            return self._finish(out)
        if not finished:
            return None, None
        return self._finish("")

    def _finish(self, pending: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """At the end: parse what was held back; send calls, or the text if there were none."""
        rest = self.text[self.sent:]
        extracted = self.plan.extract(rest)
        if not extracted.tools_called:
            return (pending + rest) or None, None
        self.called = True
        return pending or None, [c.to_openai(i) for i, c in enumerate(extracted.tool_calls)]
