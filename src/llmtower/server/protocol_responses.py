"""Request and response bodies of POST /v1/responses (OpenAI's Responses API), the subset a
text model serves: text input (a string or messages), instructions, sampling settings, the
output's format (``text.format``: plain text, a JSON schema, any JSON object), and one
assistant message of output text. The request becomes a chat completion request. Fields of
the Responses API this server does not serve are refused (400 naming them), not ignored."""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from llmtower.server.protocol import MAX_MESSAGES, ChatCompletionRequest, Count, Int64, OpenAIModel
from llmtower.server.unknown_fields import reject_unknown_fields


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
    input: str | list[InputItem] = Field(max_length=MAX_MESSAGES)
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
    tools: list[dict[str, Any]] | None = None
    # Without tools, "none" and "auto" change nothing (clients send them by default).
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
        if self.tools:
            raise ValueError("tools are not supported on /v1/responses; remove them, or call "
                             "tools through /v1/chat/completions")
        if self.include:
            raise ValueError(f"include={self.include!r} is not supported: this server adds "
                             "nothing to its output items; remove it")
        if self.tool_choice not in (None, "none", "auto"):
            raise ValueError(f"tool_choice={self.tool_choice!r} needs tools, which "
                             "/v1/responses does not support; use /v1/chat/completions")
        messages: list[dict[str, str]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            messages.append({"role": "user", "content": self.input})
        else:
            messages += [{"role": "system" if m.role == "developer" else m.role,
                          "content": m.text()} for m in self.input]
        if not messages:
            raise ValueError("input is empty: send a string or at least one message")
        return ChatCompletionRequest.model_validate({
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


class InputTokensDetails(OpenAIModel):
    cached_tokens: int = 0


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
    output: list[OutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    parallel_tool_calls: bool = False
    tool_choice: str = "none"
    tools: list[Any] = Field(default_factory=list)
    metadata: dict[str, str] | None = None
    previous_response_id: str | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    truncation: str = "disabled"
    store: bool = False
