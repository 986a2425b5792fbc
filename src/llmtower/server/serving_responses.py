"""POST /v1/responses (OpenAI's Responses API) on top of the chat path: the request becomes a
chat completion request, served by ``OpenAIServingChat``, and its answer (or its stream of
chunks) is translated into a Response object (or the Responses stream events:
response.created ... response.output_text.delta ... response.completed)."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmtower.server.protocol import ChatCompletionResponse
from llmtower.server.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from llmtower.server.serving_chat import OpenAIServingChat


def _incomplete(finish_reason: str | None) -> IncompleteDetails | None:
    return IncompleteDetails(reason="max_output_tokens") if finish_reason == "length" else None


def _usage(usage: dict[str, Any] | None) -> ResponseUsage | None:
    """The chat usage block (as JSON) in the Responses API's names."""
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(input_tokens=usage.get("prompt_tokens", 0),
                         output_tokens=usage.get("completion_tokens", 0),
                         total_tokens=usage.get("total_tokens", 0),
                         input_tokens_details=InputTokensDetails(cached_tokens=cached))


class OpenAIServingResponses:
    """Owns /v1/responses: the translation between Responses and chat completions."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _shell(self, req: ResponsesRequest) -> ResponsesResponse:
        out = ResponsesResponse(model=self.chat.model_name, instructions=req.instructions,
                                max_output_tokens=req.max_output_tokens,
                                temperature=req.temperature, top_p=req.top_p,
                                metadata=req.metadata)
        if req.text is not None:  # the format the output follows, as the request set it
            out.text = req.text.model_dump(mode="json", by_alias=True, exclude_none=True)
        return out

    async def create_response(self, req: ResponsesRequest, raw: Request) -> Response:
        answer = await self.chat.create_chat_completion(req.to_chat_request(req.stream), raw)
        if isinstance(answer, StreamingResponse):
            return StreamingResponse(self._stream(req, answer.body_iterator),
                                     media_type="text/event-stream")
        if not isinstance(answer, ChatCompletionResponse):
            return answer  # e.g. 499: the client went away
        choice = answer.choices[0]
        out = self._shell(req)
        out.status = "incomplete" if choice.finish_reason == "length" else "completed"
        out.incomplete_details = _incomplete(choice.finish_reason)
        out.output = [OutputMessage(status=out.status,
                                    content=[OutputText(text=choice.message.content or "")])]
        out.usage = _usage(answer.usage.model_dump() if answer.usage else None)
        return JSONResponse(out.model_dump(mode="json"))

    async def _stream(self, req: ResponsesRequest, chunks: AsyncIterable[Any]
                      ) -> AsyncGenerator[str, None]:
        seq = 0

        def event(kind: str, **fields: Any) -> str:
            nonlocal seq
            payload = {"type": kind, "sequence_number": seq, **fields}
            seq += 1
            return f"event: {kind}\ndata: {json.dumps(payload)}\n\n"

        response = self._shell(req)
        response.status = "in_progress"
        message = OutputMessage(status="in_progress")
        yield event("response.created", response=response.model_dump(mode="json"))
        yield event("response.in_progress", response=response.model_dump(mode="json"))
        yield event("response.output_item.added", output_index=0,
                    item=message.model_dump(mode="json"))
        part = {"type": "output_text", "text": "", "annotations": []}
        ids = {"item_id": message.id, "output_index": 0, "content_index": 0}
        yield event("response.content_part.added", **ids, part=part)
        text, finish, usage = "", None, None
        async for raw_chunk in chunks:
            data = (raw_chunk.decode() if isinstance(raw_chunk, bytes) else raw_chunk).strip()
            if not data.startswith("data: ") or data == "data: [DONE]":
                continue
            chunk = json.loads(data[len("data: "):])
            if "error" in chunk:  # the chat stream failed after it started
                response.status = "failed"
                response.error = {"code": chunk["error"].get("code") or "server_error",
                                  "message": chunk["error"].get("message", "")}
                yield event("response.failed", response=response.model_dump(mode="json"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    text += delta
                    yield event("response.output_text.delta", **ids, delta=delta, logprobs=[])
                finish = choice.get("finish_reason") or finish
        status: Literal["completed", "incomplete"] = (
            "incomplete" if finish == "length" else "completed")
        yield event("response.output_text.done", **ids, text=text, logprobs=[])
        yield event("response.content_part.done", **ids, part={**part, "text": text})
        message.status = status
        message.content = [OutputText(text=text)]
        yield event("response.output_item.done", output_index=0,
                    item=message.model_dump(mode="json"))
        response.status = status
        response.incomplete_details = _incomplete(finish)
        response.output = [message]
        response.usage = _usage(usage)
        yield event(f"response.{status}", response=response.model_dump(mode="json"))


def build_responses_router(chat: OpenAIServingChat) -> APIRouter:
    """POST /v1/responses over the chat endpoint's server."""
    router = APIRouter()
    responses = OpenAIServingResponses(chat)

    @router.post("/v1/responses")
    async def create_response(body: ResponsesRequest, raw: Request) -> Response:
        return await responses.create_response(body, raw)

    return router
