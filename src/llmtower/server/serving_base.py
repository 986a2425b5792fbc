"""What /v1/completions and /v1/chat/completions share: the model check, request ids, usage
and metrics blocks, SSE framing, merging the streams of several prompts, and waiting for an
engine result while watching for the client to hang up."""
from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any, TypeVar

from fastapi import Request

from llmtower.core.outputs import RequestMetrics
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.request_output import PromptLogprobs
from llmtower.lora.request import LoRARequest
from llmtower.server.errors import APIError, error_body, to_api_error
from llmtower.server.limits import RequestLimits
from llmtower.server.protocol import (
    PromptLogprob,
    PromptLogprobsList,
    PromptTokensDetails,
    RequestMetricsInfo,
    UsageInfo,
)

T = TypeVar("T")
_DONE = object()


class ClientDisconnected(Exception):
    """The HTTP client went away before its answer was ready; its request was aborted."""


MAX_TENANT_CHARS = 256
MAX_REQUEST_ID_CHARS = 256


class ServingBase:
    """Owns the AsyncLLM handle and the served model's name for one OpenAI endpoint."""

    def __init__(self, llm: AsyncLLM, limits: RequestLimits | None = None) -> None:
        self.llm = llm
        self.model_name = llm.model_name
        self.limits = limits or RequestLimits.for_model(llm.max_model_len)

    def tenant_of(self, req: Any, raw: Any) -> str:
        """Who a request is served for (``--policy fair``): the ``--tenant-header`` header
        (default ``X-Tenant``, set by a gateway) if present, else the OpenAI ``user`` field,
        else the default tenant ''."""
        header = getattr(self.llm.engine_args, "tenant_header", "")
        tenant = (raw.headers.get(header) if header and raw is not None else None) or \
            getattr(req, "user", None) or ""
        if len(tenant) > MAX_TENANT_CHARS:
            raise APIError(f"the tenant name ({header or 'user'}) has {len(tenant)} characters; "
                           f"use at most {MAX_TENANT_CHARS}", 400, param="user")
        return tenant

    def request_ids(self, prefix: str, req: Any, raw: Any) -> tuple[str, str]:
        """The response's id and the engine's. As vLLM, the client's own id — the
        ``X-Request-Id`` header, else the body's ``request_id`` — names the response
        (``f"{prefix}-{id}"``); the engine's id adds a random suffix, so that two requests
        that bring the same id (a retry while the first still runs) never share one."""
        given = (raw.headers.get("x-request-id") if raw is not None else None) or \
            getattr(req, "request_id", None)
        if not given:
            public = engine_id = new_request_id(prefix)
        elif len(given) > MAX_REQUEST_ID_CHARS or not all("!" <= ch <= "~" for ch in given):
            raise APIError(f"the request id (X-Request-Id header or request_id field) must be "
                           f"1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters without "
                           "spaces", 400, param="request_id")
        else:
            public = f"{prefix}-{given}"
            engine_id = f"{public}-{uuid.uuid4().hex[:8]}"
        if raw is not None and hasattr(raw, "state"):  # the X-Request-Id response header
            raw.state.request_id = public
        return public, engine_id

    def check_stop_token_ids(self, params: Any) -> None:
        """A stop token the model cannot produce is a mistake in the request (vLLM: 400)."""
        vocab = self.llm.vocab_size
        bad = [t for t in params.stop_token_ids or [] if t >= vocab]
        if bad:
            raise APIError(f"stop_token_ids names token id(s) {bad[:5]} outside the "
                           f"vocabulary of {vocab} tokens (0..{vocab - 1})", 400,
                           param="stop_token_ids")

    def check_model(self, model: str | None) -> None:
        """Any of --served-model-name's names (or none) is this server's model; a served
        LoRA adapter's name is that adapter on it."""
        if model is not None and model not in self.llm.served_model_names \
                and self.lora_request(model) is None:
            known = [self.model_name, *lora_names(self.llm)]
            raise APIError(f"the model {model!r} does not exist: this server serves "
                           f"{', '.join(map(repr, known))} (see GET /v1/models)", 404,
                           param="model", code="model_not_found")

    def response_model(self, model: str | None) -> str:
        """The ``model`` a response names: the adapter a request asked for, else the served
        model's name (as vLLM answers)."""
        return model if model is not None and self.lora_request(model) is not None \
            else self.model_name

    def lora_request(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names (None: the base model)."""
        loras = getattr(self.llm, "loras", None)
        return loras.get(model) if loras is not None else None


def lora_names(llm: Any) -> list[str]:
    loras = getattr(llm, "loras", None)
    return loras.names() if loras is not None else []


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def token_text(token_id: int, decoded: str | None, as_id: bool) -> str:
    """A token as logprobs name it: its text, or ``token_id:N`` (return_tokens_as_token_ids,
    for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_id else (decoded or "")


def prompt_logprobs_json(entries: PromptLogprobs | None, top_k: int
                         ) -> PromptLogprobsList | None:
    """``prompt_logprobs`` as vLLM sends them: per prompt token (None for the first) a map of
    token id to its logprob, rank and text, for the token and its ``top_k`` alternatives."""
    if entries is None:
        return None
    out: PromptLogprobsList = []
    for d in entries:
        if d is None:
            out.append(None)
            continue
        items = list(d.items())
        keep = items[:1] + [kv for kv in items[1:] if (kv[1].rank or 0) <= top_k]
        out.append({str(t): PromptLogprob(logprob=v.logprob, rank=v.rank,
                                          decoded_token=v.decoded_token) for t, v in keep})
    return out


def make_usage(num_prompt: int, num_completion: int, num_cached: int) -> UsageInfo:
    return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                     total_tokens=num_prompt + num_completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached))


def metrics_info(m: RequestMetrics | None) -> RequestMetricsInfo | None:
    if m is None:
        return None
    return RequestMetricsInfo(
        queue_time_ms=m.queue_time * 1e3, ttft_ms=m.ttft * 1e3,
        prefill_time_ms=m.prefill_time * 1e3, decode_time_ms=m.decode_time * 1e3,
        e2e_latency_ms=m.e2e_latency * 1e3, num_preemptions=m.num_preemptions,
        cached_tokens=m.num_cached_tokens)


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def sse_error(exc: BaseException) -> str:
    """An error after the stream started (the status line is gone): an error event."""
    err = to_api_error(exc)
    return sse(json.dumps(error_body(err.status_code, err.message, err.param, err.code)))


async def merge_streams(streams: list[AsyncGenerator[T, None]]
                        ) -> AsyncGenerator[tuple[int, T], None]:
    """Items of several async iterators as they come, tagged with the iterator's index.
    Closing the merged stream cancels (and so aborts) every stream still running."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def drain(i: int, stream: AsyncGenerator[T, None]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, _DONE))
        except Exception as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.create_task(drain(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is _DONE:
                remaining -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, awaitable: Any) -> Any:
    """Await ``awaitable`` unless the client hangs up first: then cancel it (which aborts the
    request in the engine) and raise ClientDisconnected."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected()
