"""Request and response bodies of the HTTP API, in OpenAI's shapes (pydantic models): the parts
the endpoints share. The endpoints' own bodies are beside it: ``protocol_completions.py``,
``protocol_chat.py``, ``protocol_tokenization.py``, ``protocol_responses.py``.

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

from pydantic import BaseModel, ConfigDict, Field, model_validator

import llmtower
from llmtower.core.sampling_params import SamplingParams
from llmtower.server.structured_output_fields import structured_outputs_of
from llmtower.server.text_checks import find_lone_surrogate
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


def keep_null_keys(data: dict[str, Any], *keys: str) -> dict[str, Any]:
    """``data`` with each of ``keys`` present, as null where it was left out."""
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


# Every response says which build answered (OpenAI's field; clients read it).
SYSTEM_FINGERPRINT = f"fp_llmtower_{llmtower.__version__}"


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
