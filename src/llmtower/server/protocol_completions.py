"""Request and response bodies of POST /v1/completions (OpenAI's legacy completions)."""
from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer

from llmtower.core.sampling_params import SamplingParams
from llmtower.server.protocol import (
    Count,
    MAX_LOGPROBS,
    OpenAIModel,
    PromptLogprobsList,
    RequestMetricsInfo,
    SYSTEM_FINGERPRINT,
    SamplingRequestFields,
    TokenId,
    UsageInfo,
    keep_null_keys,
)


class CompletionRequest(SamplingRequestFields):
    """POST /v1/completions."""

    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: Count | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: Count | None = None

    @property
    def echo_only(self) -> bool:
        """``echo`` with ``max_tokens=0`` (OpenAI's legacy way to score a prompt): the answer
        is the prompt alone, with its logprobs if asked; nothing generated is returned."""
        return self.echo and self.max_tokens == 0

    def to_sampling_params(self, defaults: dict[str, Any] | None = None) -> SamplingParams:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 is out of range: ask for at least 1 token, or send "
                             "echo=true as well to get the prompt (and its logprobs) alone")
        if self.suffix:
            raise ValueError("suffix is not supported; remove it from the request")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of={self.best_of} is not supported; leave it out or set "
                             f"it equal to n={self.n}")
        # Echo alone still runs one step (the engine always generates); it is not returned.
        max_tokens = 1 if self.echo_only else self.max_tokens
        return self._sampling_params(max_tokens, self.logprobs, defaults)


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobsList | None = None
    # return_token_ids (vLLM's): the prompt's ids (the first chunk of a stream) and the
    # choice's generated ids (each chunk: its new ones).
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None

    @model_serializer(mode="wrap")
    def _nulls(self, handler: Any) -> dict[str, Any]:
        # Streams are written without nulls, but clients index these two on every choice.
        return keep_null_keys(handler(self), "logprobs", "finish_reason")


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None
