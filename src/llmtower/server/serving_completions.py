"""POST /v1/completions: one or several prompts (text or token ids), streamed or not."""
from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmtower.core.outputs import RequestMetrics
from llmtower.engine.output_processor import merge_metrics
from llmtower.engine.request_output import PromptLogprobs, RequestOutput, SampleLogprobs
from llmtower.server.access_log import note_prompt, note_tokens
from llmtower.server.errors import APIError, to_api_error
from llmtower.server.frontend_options import FrontendOptions, force_usage
from llmtower.server.protocol_completions import (
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
)
from llmtower.server.direct_lane import DirectLane
from llmtower.server.sse_response import SSEResponse
from llmtower.server.stream_chunks import StreamChunkEncoder, completion_choice, plain_events
from llmtower.server.serving_base import (SSE_DONE, ClientDisconnected, ServingBase, make_usage,
                                          merge_streams, metrics_info,
                                          prompt_logprobs_json, sse, sse_error, token_text,
                                          until_disconnect)

Prompt = tuple[str | None, list[int]]


def completion_logprobs(entries: SampleLogprobs, start_offset: int = 0,
                        as_ids: bool = False) -> CompletionLogprobs:
    """OpenAI's legacy logprobs block: the sampled token, its logprob, the top alternatives
    (``{token text: logprob}``) and each token's character offset in the text. With
    ``as_ids`` (return_tokens_as_token_ids) tokens are named ``token_id:N``."""
    out = CompletionLogprobs()
    offset = start_offset
    for d in entries:
        (token_id, lp), *_ = d.items()  # the sampled token comes first
        token = token_text(token_id, lp.decoded_token, as_ids)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for t, v in d.items():  # sampled first; tokens with the same text keep the first entry
            top.setdefault(token_text(t, v.decoded_token, as_ids), v.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


class _Choice:
    """The text, tokens and logprobs one choice has gathered so far."""

    def __init__(self) -> None:
        self.text = ""
        self.num_tokens = 0
        self.token_ids: list[int] = []
        self.logprobs: SampleLogprobs | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class OpenAIServingCompletion(ServingBase):
    """Owns the /v1/completions endpoint: prompt normalisation, fan-out over prompts and
    samples, and the OpenAI response and stream formats."""

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.limits.check_n(req.n, req.best_of)
        params = req.to_sampling_params(self.llm.default_sampling)
        self.check_stop_token_ids(params)
        if req.echo and req.logprobs is not None:
            if req.stream:
                raise ValueError("echo=true with logprobs is not available when streaming: "
                                 "send stream=false, or drop echo or logprobs")
            # The echoed prompt's tokens get logprobs too: the engine scores the prompt.
            params = dataclasses.replace(
                params, prompt_logprobs=max(params.prompt_logprobs or 0, req.logprobs))
        prompts = []
        given = await self._prompts(req.prompt)
        for i, (text, ids) in enumerate(given):
            try:
                kept = self.llm.check_prompt(ids, params)  # truncate_prompt_tokens applies
            except ValueError as e:
                if len(given) == 1:
                    raise
                err = to_api_error(e)  # which prompt of the list: prompt[i]
                raise APIError(f"prompt[{i}]: {err.message}", err.status_code, "prompt",
                               err.code) from e
            prompts.append((text if len(kept) == len(ids) else None, kept))
        note_prompt(prompts[0][0])
        request_id, engine_id = self.request_ids("cmpl", req, raw)
        tenant = self.tenant_of(req, raw)
        # One stream of one sample: its plain middle tokens may take the direct lane
        # (direct_lane.py; _stream opens it where the chunks are plain).
        lane = DirectLane() if req.stream and len(prompts) == 1 and params.n == 1 else None
        streams = [self.llm.generate(text, ids, params, f"{engine_id}-{i}",
                                     priority=req.priority, cache_salt=req.cache_salt,
                                     tenant=tenant, lora_request=self.lora_request(req.model),
                                     sink=lane.deliver if lane is not None else None)
                   for i, (text, ids) in enumerate(prompts)]
        merged = merge_streams(streams)
        try:
            # Wait for the first output before answering: queue-full, timeout and admission
            # errors then still get their own HTTP status instead of a broken stream.
            first = await until_disconnect(raw, anext(merged))
        except ClientDisconnected:
            return Response(status_code=499)
        except StopAsyncIteration:  # pragma: no cover - every request yields at least once
            first = None
        if req.stream:
            return SSEResponse(self._stream(req, request_id, prompts, params.n, first, merged,
                                            lane), lane)
        try:
            return await until_disconnect(
                raw, self._collect(req, request_id, prompts, params.n, first, merged))
        except ClientDisconnected:
            return Response(status_code=499)

    def _choice_logprobs(self, req: CompletionRequest, ch: _Choice, prompt: Prompt,
                         prompt_lps: PromptLogprobs | None) -> CompletionLogprobs | None:
        """The choice's logprobs block; with echo, the prompt's tokens first (the first one
        has no logprob: nothing predicts it)."""
        if ch.logprobs is None:
            return None
        as_ids = req.return_tokens_as_token_ids
        if not req.echo:
            return completion_logprobs(ch.logprobs, as_ids=as_ids)
        prompt_lps = prompt_lps or [None]  # a one-token prompt has nothing scored
        first_id = prompt[1][0]
        first = token_text(first_id, self.llm.decode([first_id], skip_special_tokens=False),
                           as_ids)
        head = completion_logprobs([d for d in prompt_lps[1:] if d is not None], len(first),
                                   as_ids)
        offset = len(first) + sum(len(t) for t in head.tokens)
        tail = completion_logprobs(ch.logprobs, offset, as_ids)
        return CompletionLogprobs(
            text_offset=[0] + head.text_offset + tail.text_offset,
            token_logprobs=[None] + head.token_logprobs + tail.token_logprobs,
            tokens=[first] + head.tokens + tail.tokens,
            top_logprobs=[None] + head.top_logprobs + tail.top_logprobs)

    def _echo_text(self, prompt: Prompt) -> str:
        text, ids = prompt
        return text if text is not None else self.llm.decode(ids, skip_special_tokens=False)

    async def _prompts(self, prompt) -> list[Prompt]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise ValueError("prompt is empty: send a string, a list of strings, or token ids")
        if all(isinstance(p, int) for p in prompt):
            return [(None, list(prompt))]
        # Measured before tokenizing: a prompt too long in characters is refused at once.
        self.limits.check_prompt_chars(sum(len(p) for p in prompt if isinstance(p, str)))
        out: list[Prompt] = []
        for p in prompt:
            out.append((p, await self.llm.encode_async(p)) if isinstance(p, str)
                       else (None, list(p)))
        return out

    async def _collect(self, req: CompletionRequest, request_id: str, prompts: list[Prompt],
                       n: int, first, merged) -> CompletionResponse:
        choices = [_Choice() for _ in range(len(prompts) * n)]
        if req.echo:
            for k, ch in enumerate(choices):
                ch.text = self._echo_text(prompts[k // n])
        finals: list[RequestOutput] = []
        prompt_lps: list[PromptLogprobs | None] = [None] * len(prompts)
        item = first
        while item is not None:
            i, ro = item
            if ro.prompt_logprobs is not None:
                prompt_lps[i] = ro.prompt_logprobs
            for c in ro.outputs:
                ch = choices[i * n + c.index]
                if req.echo_only:  # the one token the engine made is not part of the answer
                    if c.logprobs is not None:
                        ch.logprobs = ch.logprobs or []
                    if c.finish_reason is not None:
                        ch.finish_reason = "length"
                    continue
                ch.text += c.text
                ch.num_tokens += len(c.token_ids)
                ch.token_ids += c.token_ids
                if c.logprobs is not None:
                    ch.logprobs = (ch.logprobs or []) + c.logprobs
                if c.finish_reason is not None:
                    ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason
            if ro.finished:
                finals.append(ro)
            item = await anext(merged, None)
        note_tokens(request_id, sum(len(ids) for _, ids in prompts),
                    sum(ch.num_tokens for ch in choices))
        return CompletionResponse(
            id=request_id, model=self.response_model(req.model),
            choices=[CompletionChoice(
                index=k, text=ch.text, finish_reason=ch.finish_reason, stop_reason=ch.stop_reason,
                logprobs=self._choice_logprobs(req, ch, prompts[k // n], prompt_lps[k // n]),
                prompt_logprobs=(prompt_logprobs_json(prompt_lps[k // n], req.prompt_logprobs)
                                 if req.prompt_logprobs is not None else None),
                prompt_token_ids=prompts[k // n][1] if req.return_token_ids else None,
                token_ids=ch.token_ids if req.return_token_ids else None)
                for k, ch in enumerate(choices)],
            usage=make_usage(sum(len(ids) for _, ids in prompts),
                             sum(ch.num_tokens for ch in choices),
                             sum(ro.num_cached_tokens for ro in finals)),
            metrics=metrics_info(_merged_metrics(finals)) if req.include_metrics else None)

    async def _stream(self, req: CompletionRequest, request_id: str, prompts: list[Prompt],
                      n: int, first, merged, lane: DirectLane | None = None
                      ) -> AsyncGenerator[str | bytes, None]:
        created = int(time.time())
        num_tokens = 0
        num_choices = len(prompts) * n
        offsets = [0] * num_choices
        choice_tokens = [0] * num_choices  # generated so far, per choice
        ids_sent = [False] * num_choices  # return_token_ids: the prompt's ids went out
        finals: list[RequestOutput] = []
        item = first
        # Chunks of plain text (most of a stream) skip pydantic: stream_chunks.py.
        plain = not req.return_token_ids and not req.continuous_usage
        # Asked once, not per chunk (properties of the request model).
        echo_only = req.echo_only
        metrics_on_last = req.include_metrics and not req.include_usage
        encoder = StreamChunkEncoder("text_completion", request_id, created,
                                     self.response_model(req.model))

        def chunk_of(choice: CompletionChoice, num_cached: int = 0) -> CompletionChunk:
            k = choice.index
            if req.return_token_ids:
                choice.token_ids = choice.token_ids or []
                if not ids_sent[k]:
                    choice.prompt_token_ids, ids_sent[k] = prompts[k // n][1], True
            out = CompletionChunk(id=request_id, created=created,
                                  model=self.response_model(req.model),
                                  choices=[choice])
            if req.continuous_usage:  # this choice's prompt and its tokens so far
                out.usage = make_usage(len(prompts[k // n][1]), choice_tokens[k], num_cached)
            return out

        def lane_events(ro: RequestOutput) -> bytes | None:
            """The lane's encoder, counting as the loop below counts."""
            nonlocal num_tokens
            got = plain_events(ro, encoder, completion_choice, choice_tokens)
            if got is None:
                return None
            num_tokens += got[1]
            return got[0]

        if lane is not None and plain and not req.echo:  # echo_only drops the engine's token
            lane.encode = lane_events
        try:
            if req.echo:  # the prompt first, one chunk per choice
                for k in range(num_choices):
                    yield sse(chunk_of(CompletionChoice(
                        index=k, text=self._echo_text(prompts[k // n]))
                    ).model_dump_json(exclude_none=True))
            while item is not None:
                i, ro = item
                choices: list[CompletionChoice | dict] = []
                for c in ro.outputs:
                    k = i * n + c.index
                    if echo_only:  # the one token the engine made is not returned
                        if c.finish_reason is not None:
                            choices.append(CompletionChoice(index=k, text="",
                                                            finish_reason="length"))
                        continue
                    num_tokens += len(c.token_ids)
                    choice_tokens[k] += len(c.token_ids)
                    if (not c.text and c.finish_reason is None and not c.logprobs
                            and not (req.return_token_ids and c.token_ids)):
                        continue
                    lp = None
                    if c.logprobs:
                        lp = completion_logprobs(c.logprobs, offsets[k],
                                                 req.return_tokens_as_token_ids)
                        offsets[k] += sum(len(t) for t in lp.tokens)
                    elif plain:  # the common chunk: no pydantic model
                        choices.append(completion_choice(k, c.text, c.finish_reason,
                                                         c.stop_reason))
                        continue
                    choices.append(CompletionChoice(
                        index=k, text=c.text, logprobs=lp, finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None))
                if ro.finished:
                    finals.append(ro)
                for j, choice in enumerate(choices):  # one choice per chunk, as OpenAI does
                    with_metrics = metrics_on_last and ro.finished and j == len(choices) - 1
                    if isinstance(choice, dict):
                        if not with_metrics:
                            yield encoder.event(choice)
                            continue
                        choice = CompletionChoice(**choice)
                    chunk = chunk_of(choice, ro.num_cached_tokens)
                    if with_metrics:
                        chunk.metrics = metrics_info(ro.metrics)
                    yield sse(chunk.model_dump_json(exclude_none=True))
                item = await anext(merged, None)
            note_tokens(request_id, sum(len(ids) for _, ids in prompts), num_tokens)
            if req.include_usage:
                usage_chunk = CompletionChunk(
                    id=request_id, created=created, model=self.response_model(req.model),
                    choices=[],
                    usage=make_usage(sum(len(ids) for _, ids in prompts), num_tokens,
                                     sum(ro.num_cached_tokens for ro in finals)))
                if req.include_metrics:
                    usage_chunk.metrics = metrics_info(_merged_metrics(finals))
                yield sse(usage_chunk.model_dump_json(exclude_none=True))
        except Exception as e:  # the status line is gone: report in the stream
            yield sse_error(e)
        finally:
            await merged.aclose()
        yield SSE_DONE


def _merged_metrics(finals: list[RequestOutput]) -> RequestMetrics | None:
    return merge_metrics([ro.metrics for ro in finals])


def build_completions_router(completions: OpenAIServingCompletion,
                             frontend: FrontendOptions) -> APIRouter:
    """POST /v1/completions."""
    router = APIRouter()

    @router.post("/v1/completions")
    async def create_completion(body: CompletionRequest, raw: Request) -> Response:
        return await completions.create_completion(force_usage(body, frontend), raw)

    return router
