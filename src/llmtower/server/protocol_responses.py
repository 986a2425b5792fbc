"""Request and response bodies of POST /v1/responses (OpenAI's Responses API), the subset a
text model serves: text input (a string or messages, function calls and their outputs),
instructions, sampling settings, the output's format (``text.format``: plain text, a JSON
schema, any JSON object), function tools with ``tool_choice``, and as output an assistant
message and/or function calls. The request becomes a chat completion request. Fields of the
Responses API this server does not serve are refused (400 naming them), not ignored."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag, model_validator

from llmtower.server.protocol import Count, Int64, MAX_MESSAGES, MAX_TOOLS, OpenAIModel
from llmtower.server.protocol_chat import ChatCompletionRequest
from llmtower.server.unknown_fields import ignore_or_refuse, reject_unknown_fields


class InputContentPart(OpenAIModel):
    type: str  # input_text (output_text when a previous answer is sent back)
    text: str | None = None


class InputItem(OpenAIModel):
    """One message of ``input``; ``type`` is "message" or left out (the easy form)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContentPart]

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        parts = []
        for p in self.content:
            if p.type not in ("input_text", "output_text", "text"):
                raise ValueError(f"input content of type {p.type!r} is not supported; send "
                                 "input_text only")
            parts.append(p.text or "")
        return "".join(parts)


class FunctionCallItem(OpenAIModel):
    """A function call of an earlier answer, sent back in ``input``."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None

    def chat_call(self) -> dict[str, Any]:
        return {"id": self.call_id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


class FunctionCallOutputItem(OpenAIModel):
    """What the client's function returned for one call (``call_id``)."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputContentPart]
    id: str | None = None
    status: str | None = None

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        parts = []
        for p in self.output:
            if p.type not in ("input_text", "output_text", "text"):
                raise ValueError(f"function_call_output content of type {p.type!r} is not "
                                 "supported; send the output as a string or input_text parts")
            parts.append(p.text or "")
        return "".join(parts)


def _input_kind(item: Any) -> str:
    kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", None)
    return kind or "message"


AnyInputItem = Annotated[
    Annotated[InputItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_input_kind, custom_error_type="input_item_type",
                  custom_error_message="input items must be of type 'message', "
                                       "'function_call' or 'function_call_output'")]

FUNCTION_TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
NAMED_CHOICE = '{"type": "function", "name": "..."}'


def chat_tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The Responses API's function tools (name, parameters, ... at the top) in the chat
    completions shape; other tool types (web_search, file_search, ...) are a ValueError."""
    other = [t.get("type") if isinstance(t, dict) else t for t in tools
             if not isinstance(t, dict) or t.get("type") != "function"]
    if other:
        raise ValueError(f"tools of type {', '.join(repr(o) for o in other)} are not supported: "
                         "this server calls function tools only ({\"type\": \"function\", "
                         "\"name\": ..., \"parameters\": {...}}); remove the others")
    out = []
    for i, tool in enumerate(tools):
        if "function" in tool:
            raise ValueError(f"tools[{i}] has the chat completions shape; the Responses API "
                             "puts the function's fields at the top: {\"type\": \"function\", "
                             "\"name\": ..., \"description\": ..., \"parameters\": {...}}")
        unknown = sorted(k for k, v in tool.items()
                         if k not in FUNCTION_TOOL_FIELDS and v is not None)
        if unknown:
            ignore_or_refuse(unknown, f"tools[{i}]",
                             f" (a function tool has {', '.join(FUNCTION_TOOL_FIELDS)})")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ValueError(f"tools[{i}].name must be a non-empty string")
        if tool.get("parameters") is not None and not isinstance(tool["parameters"], dict):
            raise ValueError(f"tools[{i}].parameters must be a JSON schema object")
        out.append({"type": "function", "function": {
            k: v for k, v in tool.items() if k in FUNCTION_TOOL_FIELDS[1:] and v is not None}})
    return out


def chat_tool_choice(choice: Any, has_tools: bool) -> Any:
    """The Responses API's ``tool_choice`` as chat's: the strings as they are, a named function
    ``{"type": "function", "name": N}`` as ``{"type": "function", "function": {"name": N}}``."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"tool_choice={choice!r} is invalid: use \"none\", \"auto\", "
                             f"\"required\" or {NAMED_CHOICE}")
        # Without tools, "none" and "auto" change nothing (clients send them by default).
        return choice if has_tools or choice == "required" else None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = choice.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tool_choice={choice!r} needs the function's name at the top: "
                             f"{NAMED_CHOICE}")
        return {"type": "function", "function": {"name": name}}
    raise ValueError(f"tool_choice={choice!r} is not supported: use \"none\", \"auto\", "
                     f"\"required\" or {NAMED_CHOICE} (this server calls function tools only)")


class TextFormat(OpenAIModel):
    """``text.format``: the Responses API's response_format (the schema's fields inline)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return reject_unknown_fields(cls, data)

    type: Literal["text", "json_schema", "json_object"] = "text"
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    def response_format(self) -> dict[str, Any] | None:
        """The chat request's ``response_format`` for this format (None: plain text)."""
        if self.type == "json_object":
            return {"type": "json_object"}
        if self.type == "json_schema":
            if self.schema_ is None:
                raise ValueError("text.format of type json_schema needs its schema: send "
                                 "text={\"format\": {\"type\": \"json_schema\", \"name\": ..., "
                                 "\"schema\": {...}}}")
            return {"type": "json_schema", "json_schema": {
                "name": self.name, "description": self.description, "schema": self.schema_,
                "strict": self.strict}}
        return None


class TextConfig(OpenAIModel):
    """``text``: how the output text is formatted."""

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return reject_unknown_fields(cls, data)

    format: TextFormat = Field(default_factory=lambda: TextFormat(type="text", schema=None))


class ResponsesRequest(OpenAIModel):
    """POST /v1/responses."""

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return reject_unknown_fields(cls, data)

    model: str | None = None
    input: str | list[AnyInputItem] = Field(max_length=MAX_MESSAGES)
    instructions: str | None = None
    max_output_tokens: Count | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stream: bool = False
    previous_response_id: str | None = None
    # Function tools (others are refused); tool_choice "none", "auto", "required" or a named
    # function, enforced as chat completions enforce them.
    tools: list[Any] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Accepted at the values that change nothing ([], "disabled"); others are 400s.
    include: list[str] | None = None
    truncation: Literal["disabled"] | None = None
    store: bool | None = None  # accepted; nothing is stored
    metadata: dict[str, str] | None = None
    user: str | None = None
    text: TextConfig | None = None

    def to_chat_request(self, stream: bool) -> ChatCompletionRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id is not supported (this server stores no "
                             "responses): send the whole conversation in input")
        if self.include:
            raise ValueError(f"include={self.include!r} is not supported: this server adds "
                             "nothing to its output items; remove it")
        tools = chat_tools(self.tools or [])
        tool_choice = chat_tool_choice(self.tool_choice, bool(tools))
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            for m in self.input:
                if isinstance(m, FunctionCallItem):
                    # Calls join the assistant message before them (its text, its other calls).
                    last = messages[-1] if messages else None
                    if last is not None and last["role"] == "assistant":
                        last.setdefault("tool_calls", []).append(m.chat_call())
                    else:
                        messages.append({"role": "assistant", "content": None,
                                         "tool_calls": [m.chat_call()]})
                elif isinstance(m, FunctionCallOutputItem):
                    messages.append({"role": "tool", "tool_call_id": m.call_id,
                                     "content": m.text()})
                else:
                    messages.append({"role": "system" if m.role == "developer" else m.role,
                                     "content": m.text()})
        if not messages:
            raise ValueError("input is empty: send a string or at least one message")
        return ChatCompletionRequest.model_validate({
            "tools": tools or None, "tool_choice": tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "seed": self.seed, "stream": stream, "user": self.user,
            "response_format": self.text.format.response_format() if self.text else None,
            "stream_options": {"include_usage": True} if stream else None})


class OutputText(OpenAIModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(OpenAIModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText] = Field(default_factory=list)


class OutputFunctionCall(OpenAIModel):
    """A function call of the answer (``call_id`` is the chat tool call's id)."""

    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: f"fc_{uuid.uuid4().hex}")
    call_id: str
    name: str
    arguments: str = ""
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ReasoningText(OpenAIModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class OutputReasoning(OpenAIModel):
    """The answer's thinking (--reasoning-parser), an item before its message."""

    type: Literal["reasoning"] = "reasoning"
    id: str = Field(default_factory=lambda: f"rs_{uuid.uuid4().hex}")
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0
    cache_write_tokens: int = 0  # required by the SDK's type; nothing is billed for writes


class OutputTokensDetails(OpenAIModel):
    reasoning_tokens: int = 0


class ResponseUsage(OpenAIModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class IncompleteDetails(OpenAIModel):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponsesResponse(OpenAIModel):
    """A Response object (``object: "response"``)."""

    id: str = Field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed"] = "completed"
    model: str
    output: list[OutputReasoning | OutputMessage | OutputFunctionCall] = Field(
        default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = True
    tool_choice: Any = "none"
    tools: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = False
