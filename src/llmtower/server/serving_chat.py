"""POST /v1/chat/completions: the conversation through the model's chat template, then one
request with ``n`` samples, streamed (first delta carries the role) or not."""
from __future__ import annotations

import time
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from llmtower.engine.request_output import RequestOutput, SampleLogprobs
from llmtower.server.access_log import note_prompt, note_tokens
from llmtower.server.frontend_options import FrontendOptions, force_usage
from llmtower.server.protocol_chat import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatLogprobToken,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    continue_final_kwargs,
)
from llmtower.server.reasoning import ReasoningParser
from llmtower.server.direct_lane import DirectLane
from llmtower.server.sse_response import SSEResponse
from llmtower.server.stream_chunks import StreamChunkEncoder, chat_choice, plain_events
from llmtower.server.serving_base import (SSE_DONE, ClientDisconnected, ServingBase, make_usage,
                                          merge_streams, metrics_info, prompt_logprobs_json, sse,
                                          sse_error, token_text, until_disconnect)
from llmtower.server.tool_parsers.tool_choice import (ToolCallStreamer, ToolPlan, ToolSettings,
                                                      constrain_to_tools, plan_tools,
                                                      tool_finish_reason)

ROLE = "assistant"


def tool_message(plan: ToolPlan | None, text: str) -> ChatResponseMessage:
    """The assistant message of one choice: its tool calls (if the plan finds any) or text."""
    if plan is None or plan.mode == "none":
        return ChatResponseMessage(role=ROLE, content=text)
    extracted = plan.extract(text)
    if not extracted.tools_called:
        return ChatResponseMessage(role=ROLE, content=text)
    return ChatResponseMessage(role=ROLE, content=extracted.content,
                               tool_calls=[c.to_openai() for c in extracted.tool_calls])


def reasoning_message(plan: ToolPlan | None, text: str,
                      reasoner: ReasoningParser | None) -> ChatResponseMessage:
    """``tool_message`` with --reasoning-parser: the thinking split off first, tool calls
    looked for in the rest only."""
    if reasoner is None:
        return tool_message(plan, text)
    reasoning, content = reasoner.extract_reasoning(text)
    message = (tool_message(plan, content) if content is not None
               else ChatResponseMessage(role=ROLE, content=None))
    message.reasoning_content = message.reasoning = reasoning
    return message


def chat_logprobs(entries: SampleLogprobs, top_k: int, as_ids: bool = False) -> ChatLogprobs:
    """OpenAI's chat logprobs: per token its text (``token_id:N`` with
    return_tokens_as_token_ids), logprob and UTF-8 bytes, with the ``top_k`` most likely
    alternatives."""
    content = []
    for d in entries:
        (sampled_id, lp), *_ = d.items()  # the sampled token comes first
        ranked = sorted(d.items(), key=lambda kv: kv[1].rank if kv[1].rank is not None else 1 << 30)
        top = [TopLogprob(token=token_text(t, v.decoded_token, as_ids), logprob=v.logprob,
                          bytes=list((v.decoded_token or "").encode()))
               for t, v in ranked[:top_k]]
        token = token_text(sampled_id, lp.decoded_token, as_ids)
        content.append(ChatLogprobToken(token=token, logprob=lp.logprob,
                                        bytes=list(token.encode()), top_logprobs=top))
    return ChatLogprobs(content=content)


def echo_text(req: ChatCompletionRequest) -> str:
    """With ``echo``, the last message's text when it is the assistant's (the reply continues
    it, as vLLM does), else nothing."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == ROLE else ""


class OpenAIServingChat(ServingBase):
    """Owns the /v1/chat/completions endpoint: chat template, tool calling, and the chat
    response and chunk formats."""

    def __init__(self, llm: Any, limits: Any = None,
                 tool_settings: ToolSettings | None = None,
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(llm, limits)
        self.tool_settings = tool_settings or ToolSettings()
        self.reasoning_parser = reasoning_parser

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        self.check_model(req.model)
        self.limits.check_n(req.n)
        params = req.to_sampling_params(self.llm.default_sampling)
        self.check_stop_token_ids(params)
        # Tools: a constraint for "required" / a named function, the template's tools.
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                          self.tool_settings)
        params = constrain_to_tools(params, plan)
        # A grammar (structured output, a required / named tool) holds from the first token,
        # so such an answer has no thinking: all of it is content.
        reasoner = self.reasoning_parser if params.structured_outputs is None else None
        if reasoner is not None and reasoner.needs_special_tokens:
            params.skip_special_tokens = False  # the format's markers are special tokens
        prompt, ids = await self.render_prompt(
            req.messages, req.add_generation_prompt, req.continue_final_message,
            req.template_kwargs(), req.chat_template, plan.template_tools())
        ids = self.llm.check_prompt(ids, params)  # truncated if truncate_prompt_tokens asks
        note_prompt(prompt)
        request_id, engine_id = self.request_ids("chatcmpl", req, raw)
        # One stream of one sample: its plain middle tokens may take the direct lane
        # (direct_lane.py; _stream opens it where the chunks are plain).
        lane = DirectLane() if req.stream and params.n == 1 else None
        stream = merge_streams([self.llm.generate(prompt, ids, params, engine_id,
                                                  priority=req.priority,
                                                  cache_salt=req.cache_salt,
                                                  tenant=self.tenant_of(req, raw),
                                                  lora_request=self.lora_request(req.model),
                                                  sink=lane.deliver if lane else None)])
        try:
            # The first output decides the status: queue-full, timeout and admission errors
            # get their own HTTP status instead of a broken stream.
            first = await until_disconnect(raw, anext(stream))
        except ClientDisconnected:
            return Response(status_code=499)
        top_k = req.top_logprobs or 0
        if req.stream:
            return SSEResponse(self._stream(req, request_id, ids, params.n, top_k, first,
                                            stream, plan, reasoner, lane), lane)
        try:
            return await until_disconnect(
                raw, self._collect(req, request_id, ids, params.n, top_k, first, stream,
                                   plan, reasoner))
        except ClientDisconnected:
            return Response(status_code=499)

    async def render_prompt(self, messages: list[ChatMessage], add_generation_prompt: bool,
                            continue_final_message: bool,
                            chat_template_kwargs: dict[str, Any] | None,
                            chat_template: str | None,
                            tools: list[dict[str, Any]] | None) -> tuple[str, list[int]]:
        """The prompt (text, token ids) of a conversation through the chat template, with the
        template's variables and ``tools``: what this endpoint sends to the engine, and what
        /tokenize counts."""
        template_kwargs = self.limits.check_template_kwargs(chat_template_kwargs, chat_template)
        if tools:
            template_kwargs["tools"] = tools
        template_kwargs.update(continue_final_kwargs(continue_final_message,
                                                     add_generation_prompt))
        conversation = [m.for_template() for m in messages]
        self.limits.check_prompt_chars(sum(len(m["content"]) for m in conversation), "messages")
        return await self.llm.render_chat_async(conversation, add_generation_prompt,
                                                **template_kwargs)

    async def _collect(self, req: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                       n: int, top_k: int, first, stream,
                       plan: ToolPlan | None = None,
                       reasoner: ReasoningParser | None = None) -> ChatCompletionResponse:
        num_prompt = len(prompt_ids)
        texts = [""] * n
        num_tokens = [0] * n
        token_ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[SampleLogprobs] = [[] for _ in range(n)]
        finish: list[tuple[str | None, int | str | None]] = [(None, None)] * n
        final: RequestOutput | None = None
        prompt_lps = None
        item = first
        while item is not None:
            _, ro = item
            prompt_lps = ro.prompt_logprobs or prompt_lps
            for c in ro.outputs:
                texts[c.index] += c.text
                num_tokens[c.index] += len(c.token_ids)
                token_ids[c.index] += c.token_ids
                if c.logprobs:
                    logprobs[c.index].extend(c.logprobs)
                if c.finish_reason is not None:
                    finish[c.index] = (c.finish_reason, c.stop_reason)
            if ro.finished:
                final = ro
            item = await anext(stream, None)
        note_tokens(request_id, num_prompt, sum(num_tokens))
        echo = echo_text(req)
        messages = [reasoning_message(plan, echo + texts[i], reasoner) for i in range(n)]
        return ChatCompletionResponse(
            id=request_id, model=self.response_model(req.model),
            choices=[ChatChoice(
                index=i, message=messages[i],
                logprobs=(chat_logprobs(logprobs[i], top_k, req.return_tokens_as_token_ids)
                          if req.logprobs else None),
                finish_reason=tool_finish_reason(finish[i][0], bool(messages[i].tool_calls)),
                stop_reason=finish[i][1],
                token_ids=token_ids[i] if req.return_token_ids else None) for i in range(n)],
            prompt_token_ids=prompt_ids if req.return_token_ids else None,
            usage=make_usage(num_prompt, sum(num_tokens),
                             final.num_cached_tokens if final else 0),
            prompt_logprobs=(prompt_logprobs_json(prompt_lps, req.prompt_logprobs)
                             if req.prompt_logprobs is not None else None),
            metrics=metrics_info(final.metrics if final else None) if req.include_metrics
            else None)

    async def _stream(self, req: ChatCompletionRequest, request_id: str, prompt_ids: list[int],
                      n: int, top_k: int, first, stream,
                      plan: ToolPlan | None = None,
                      reasoner: ReasoningParser | None = None,
                      lane: DirectLane | None = None
                      ) -> AsyncGenerator[str | bytes, None]:
        created = int(time.time())
        model = self.response_model(req.model)
        num_prompt = len(prompt_ids)
        choice_tokens = [0] * n  # generated so far, per choice
        ids_sent = False  # return_token_ids: the prompt's ids go on the first chunk

        def chunk(choices: list[ChatStreamChoice], num_cached: int = 0) -> ChatCompletionChunk:
            nonlocal ids_sent
            out = ChatCompletionChunk(id=request_id, created=created, model=model,
                                      choices=choices)
            if req.return_token_ids and not ids_sent:
                out.prompt_token_ids, ids_sent = prompt_ids, True
            if req.continuous_usage and choices:  # the prompt and this choice's tokens so far
                out.usage = make_usage(num_prompt, choice_tokens[choices[0].index], num_cached)
            return out

        # One choice per chunk, as OpenAI streams n > 1.
        thinkers = [reasoner.streamer() for _ in range(n)] if reasoner is not None else None
        echo = echo_text(req)
        for i in range(n):
            first_delta = DeltaMessage(role=ROLE, content=echo)
            if thinkers is not None:  # the echo is split as the text that follows it
                first_delta.reasoning_content, first_delta.content = thinkers[i].feed(echo)
                first_delta.reasoning = first_delta.reasoning_content
            yield sse(chunk([ChatStreamChoice(index=i, delta=first_delta)]).model_dump_json(
                exclude_none=True))
        num_tokens = 0
        final: RequestOutput | None = None
        item = first
        streamers = [ToolCallStreamer(plan) for _ in range(n)] if plan is not None else None
        # Chunks of plain content (most of a stream) skip pydantic: stream_chunks.py.
        plain = (not req.return_token_ids and not req.continuous_usage and thinkers is None
                 and streamers is None)
        encoder = StreamChunkEncoder("chat.completion.chunk", request_id, created, model)
        metrics_on_last = req.include_metrics and not req.include_usage  # asked once

        def lane_events(ro: RequestOutput) -> bytes | None:
            """The lane's encoder, counting as the loop below counts."""
            nonlocal num_tokens
            got = plain_events(ro, encoder, chat_choice, choice_tokens)
            if got is None:
                return None
            num_tokens += got[1]
            return got[0]

        if lane is not None and plain:
            lane.encode = lane_events
        try:
            while item is not None:
                _, ro = item
                choices: list[ChatStreamChoice | dict] = []
                for c in ro.outputs:
                    num_tokens += len(c.token_ids)
                    choice_tokens[c.index] += len(c.token_ids)
                    wants_ids = req.return_token_ids and bool(c.token_ids)
                    text: str | None = c.text
                    delta = DeltaMessage(content=text or None)
                    finish_reason = c.finish_reason
                    if thinkers is not None:  # the thinking first; the rest is content
                        delta.reasoning_content, text = thinkers[c.index].feed(
                            c.text, c.finish_reason is not None)
                        delta.reasoning, delta.content = delta.reasoning_content, text
                    if streamers is not None:  # tool calls: content and/or call deltas
                        s = streamers[c.index]
                        delta.content, delta.tool_calls = s.feed(text or "",
                                                                 c.finish_reason is not None)
                        finish_reason = tool_finish_reason(c.finish_reason, s.called)
                    if (delta.content is None and delta.tool_calls is None
                            and delta.reasoning_content is None and c.finish_reason is None
                            and not c.logprobs and not wants_ids):
                        continue
                    if plain and not c.logprobs:  # the common chunk: no pydantic model
                        choices.append(chat_choice(c.index, delta.content, finish_reason,
                                                   c.stop_reason))
                        continue
                    choices.append(ChatStreamChoice(
                        index=c.index, delta=delta,
                        logprobs=(chat_logprobs(c.logprobs, top_k, req.return_tokens_as_token_ids)
                                  if c.logprobs else None),
                        finish_reason=finish_reason, stop_reason=c.stop_reason,
                        token_ids=list(c.token_ids) if req.return_token_ids else None))
                if ro.finished:
                    final = ro
                for k, choice in enumerate(choices):
                    with_metrics = metrics_on_last and ro.finished and k == len(choices) - 1
                    if isinstance(choice, dict):
                        if not with_metrics:
                            yield encoder.event(choice)
                            continue
                        choice = ChatStreamChoice(**choice)
                    out = chunk([choice], ro.num_cached_tokens)
                    if with_metrics:
                        out.metrics = metrics_info(ro.metrics)
                    yield sse(out.model_dump_json(exclude_none=True))
                item = await anext(stream, None)
            note_tokens(request_id, num_prompt, num_tokens)
            if req.include_usage:
                out = chunk([])
                out.usage = make_usage(num_prompt, num_tokens,
                                       final.num_cached_tokens if final else 0)
                if req.include_metrics:
                    out.metrics = metrics_info(final.metrics if final else None)
                yield sse(out.model_dump_json(exclude_none=True))
        except Exception as e:  # the status line is gone: report in the stream
            yield sse_error(e)
        finally:
            await stream.aclose()
        yield SSE_DONE


def build_chat_router(chat: OpenAIServingChat, frontend: FrontendOptions) -> APIRouter:
    """POST /v1/chat/completions."""
    router = APIRouter()

    @router.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(force_usage(body, frontend), raw)

    return router
