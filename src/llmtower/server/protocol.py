"""Request and response bodies of the HTTP API, in OpenAI's shapes (pydantic models).

Requests accept OpenAI's parameters plus vLLM-style extensions (top_k, min_p, min_tokens,
ignore_eos, repetition_penalty, priority, cache_salt, include_metrics, ...). Unknown fields
are ignored, as OpenAI-compatible servers do, so newer clients keep working. Range checks
live in ``SamplingParams`` so that the offline API and the server say the same thing.
"""
from __future__ import annotations

import time
import typing
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

import llmtower
from llmtower.core.sampling_params import SamplingParams
from llmtower.server.structured_output_fields import structured_outputs_of
from llmtower.server.text_checks import find_lone_surrogate
from llmtower.server.tool_parsers.base import template_tool_call
from llmtower.server.unknown_fields import reject_unknown_fields


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _accepts_none(annotation: Any) -> bool:
    return annotation is Any or annotation is type(None) or \
        type(None) in typing.get_args(annotation)


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_absent(cls, data: Any) -> Any:
        # Many clients send every optional field, unset ones as null ("n": null,
        # "stream": null): as OpenAI and vLLM, such a null means "the default", not a 400.
        if isinstance(data, dict) and None in data.values():
            fields = cls.model_fields
            data = {k: v for k, v in data.items()
                    if not (v is None and k in fields and not fields[k].is_required()
                            and not _accepts_none(fields[k].annotation))}
        return data

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        # JSON may spell a lone UTF-16 surrogate ("\\ud800"); Python accepts it into a str,
        # but no tokenizer or encoder can take it: refuse it here as a 400 naming the field.
        if isinstance(data, dict):
            for key, value in data.items():
                where = find_lone_surrogate(value)
                if where is not None:
                    raise ValueError(f"{key}{where} holds a lone UTF-16 surrogate, which is "
                                     "not valid Unicode text: send valid UTF-8")
        return data


# Bounds on every integer a request may carry (issue 11): an unbounded int reaches the msgpack
# encoder or torch and fails there as a 500; bounded here it is a 400 that names the field.
Int64 = Annotated[int, Field(ge=-2**63, le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
Count = Annotated[int, Field(ge=0, le=2**31 - 1)]
# Caps on list sizes that scale the work of one request (OpenAI's limits where it has them).
MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 512
MAX_MESSAGES = 4096
MAX_TOOLS = 128
StopString = Annotated[str, Field(max_length=MAX_STOP_STRING_CHARS)]


# ============================================================================ requests
class StreamOptions(OpenAIModel):
    # null is "not asked" (vLLM accepts it too).
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class JsonSchemaFormat(OpenAIModel):
    """``response_format.json_schema``: OpenAI's named schema (always enforced strictly)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: str = "text"
    json_schema: JsonSchemaFormat | None = None


class SamplingRequestFields(OpenAIModel):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    @model_validator(mode="before")
    @classmethod
    def _no_unknown_fields(cls, data: Any) -> Any:
        return reject_unknown_fields(cls, data)

    model: str | None = None
    n: Count = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: StopString | list[StopString] | None = Field(None, max_length=MAX_STOP_STRINGS)
    seed: Int64 | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM's names).
    top_k: Annotated[int, Field(ge=-1, le=2**31 - 1)] | None = None
    min_p: float | None = None
    min_tokens: Count = 0
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int64 = 0
    cache_salt: str | None = None
    include_metrics: bool = False
    request_id: str | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool = False  # vLLM's: the token ids of the prompt and of each choice
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=2**31 - 1)] | None = None
    # Structured outputs (vLLM's names; see docs/structured_outputs.md): one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         defaults: dict[str, Any] | None = None) -> SamplingParams:
        """``defaults`` (generation_config.json's, --generation-config) fill what the request
        leaves out."""
        d = defaults or {}
        self._check_stream_options()

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bad_keys = [t for t in self.logit_bias or {} if not _is_int(t)]
        if bad_keys:
            raise ValueError(f"logit_bias=... is invalid: its keys must be token ids, e.g. "
                             f"{{\"50256\": -100}}; not {', '.join(map(repr, bad_keys[:10]))}")
        logit_bias = {int(t): b for t, b in (self.logit_bias or {}).items()}
        return SamplingParams(
            n=self.n,
            temperature=pick(self.temperature, "temperature", 1.0),
            top_p=pick(self.top_p, "top_p", 1.0),
            top_k=pick(self.top_k, "top_k", 0),
            min_p=pick(self.min_p, "min_p", 0.0),
            seed=self.seed,
            max_tokens=pick(max_tokens, "max_tokens", None),
            logit_bias=logit_bias or None,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            prompt_logprobs=self._prompt_logprobs(),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=structured_outputs_of(self))

    def _check_stream_options(self) -> None:
        if self.stream_options is not None and self.stream_options.model_fields_set \
                and not self.stream:
            # As OpenAI and vLLM: usage options of a stream that is not one are a mistake.
            raise ValueError("stream_options=... applies only to streamed responses: send "
                             "stream=true, or leave stream_options out")

    def _prompt_logprobs(self) -> int | None:
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs=... is not available when streaming: send "
                             "stream=false, or leave prompt_logprobs out")
        return self.prompt_logprobs

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's ``stream_options.continuous_usage_stats`` (with ``include_usage``): every
        chunk carries the usage so far."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)


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

    def conversation(self) -> list[dict[str, Any]]:
        return [m.for_template() for m in self.messages]


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages (the chat template is applied)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, max_length=MAX_MESSAGES)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # As for chat (vLLM's /tokenize takes them): what the template renders besides messages.
    tools: list[dict[str, Any]] | None = Field(None, max_length=MAX_TOOLS)
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False  # vLLM's: each token's string in the vocabulary too


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


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[TokenId]


# ============================================================================ responses
class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class RequestMetricsInfo(OpenAIModel):
    """The ``include_metrics`` extension: where one request spent its time (milliseconds)."""

    queue_time_ms: float
    ttft_ms: float
    prefill_time_ms: float
    decode_time_ms: float
    e2e_latency_ms: float
    num_preemptions: int
    cached_tokens: int


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


def _keep_null_keys(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    for key in keys:
        data.setdefault(key, None)
    return data


class PromptLogprob(OpenAIModel):
    """One token's entry in ``prompt_logprobs`` (vLLM's shape)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per prompt token, {token id: entry} for it and its top alternatives; None for the first.
PromptLogprobsList = list[dict[str, PromptLogprob] | None]


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
        return _keep_null_keys(handler(self), "logprobs", "finish_reason")


# Every response says which build answered (OpenAI's field; clients read it).
SYSTEM_FINGERPRINT = f"fp_llmtower_{llmtower.__version__}"


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None


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
        return _keep_null_keys(handler(self), "logprobs", "finish_reason")


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


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = SYSTEM_FINGERPRINT
    usage: UsageInfo | None = None
    metrics: RequestMetricsInfo | None = None


class ModelPermission(OpenAIModel):
    """OpenAI's (legacy) model permission block, as vLLM serves it: everything allowed."""

    id: str = Field(default_factory=lambda: f"modelperm-{uuid.uuid4().hex}")
    object: Literal["model_permission"] = "model_permission"
    created: int = Field(default_factory=lambda: int(time.time()))
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "llmtower"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None
    permission: list[ModelPermission] = Field(default_factory=lambda: [ModelPermission()])


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
