"""Request and response bodies of POST /v1/chat/completions: messages, the chat request, and
the chat response, its logprobs and its stream chunks."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer

from llmtower.core.sampling_params import SamplingParams
from llmtower.server.protocol import (
    Count,
    MAX_LOGPROBS,
    MAX_MESSAGES,
    MAX_TOOLS,
    OpenAIModel,
    PromptLogprobsList,
    RequestMetricsInfo,
    ResponseFormat,
    SYSTEM_FINGERPRINT,
    SamplingRequestFields,
    UsageInfo,
    keep_null_keys,
)
from llmtower.server.tool_parsers.base import template_tool_call


class ContentPart(OpenAIModel):
    type: str
    text: str | None = None


class ChatMessage(OpenAIModel):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # Tool calling: an assistant's calls, and a tool message's answer to one of them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates read it (tool-call arguments as objects)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            d["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        return d

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for p in self.content:
            if p.type != "text":
                raise ValueError(f"message content of type {p.type!r} is not supported; "
                                 "send text only")
            parts.append(p.text or "")
        return "".join(parts)


class ChatCompletionRequest(SamplingRequestFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: Count | None = None
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    add_generation_prompt: bool = True
    # vLLM's: the prompt ends inside the last (assistant) message, which the reply continues.
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    # Replaces the template for this request: only with --trust-request-chat-template.
    chat_template: str | None = None
    # vLLM's chat echo: a last message of the assistant's role is continued, and echoed.
    echo: bool = False
    # OpenAI's: how hard a reasoning model thinks; the template's ``reasoning_effort``
    # (gpt-oss's), unless chat_template_kwargs sets that itself.
    reasoning_effort: Literal["low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any] | None:
        """chat_template_kwargs, with reasoning_effort among them when it is set."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_completion_tokens == 0:  # named as sent, not as max_tokens
            raise ValueError("max_completion_tokens=0 is out of range: ask for at least 1 "
                             "token, or leave it out")
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, defaults)


def continue_final_kwargs(continue_final_message: bool, add_generation_prompt: bool
                          ) -> dict[str, Any]:
    """The renderer's argument for ``continue_final_message`` (vLLM's rule: not with a
    generation prompt, which would open a new message instead)."""
    if not continue_final_message:
        return {}
    if add_generation_prompt:
        raise ValueError("continue_final_message=true cannot be combined with "
                         "add_generation_prompt=true (the default): send "
                         "add_generation_prompt=false to continue the last message")
    return {"continue_final_message": True}


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    # OpenAI's message fields, null here; clients read them without checking they exist.
    refusal: str | None = None
    annotations: list[dict[str, Any]] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    # --reasoning-parser: the thinking (vLLM's two names), left out of the JSON when none.
    reasoning_content: str | None = None
    reasoning: str | None = None

    @model_serializer(mode="wrap")
    def _no_null_reasoning(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        for key in ("reasoning_content", "reasoning"):
            if out.get(key, "") is None:
                del out[key]
        return out


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning_content: str | None = None  # --reasoning-parser (both of vLLM's names)
    reasoning: str | None = None


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # return_token_ids: this chunk's new ids

    @model_serializer(mode="wrap")
    def _nulls(self, handler: Any) -> dict[str, Any]:
        # Streams are written without nulls, but clients index these two on every chunk.
        return keep_null_keys(handler(self), "logprobs", "finish_reason")


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: on the first chunk
