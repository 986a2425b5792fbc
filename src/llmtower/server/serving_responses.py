"""POST /v1/responses (OpenAI's Responses API) on top of the chat path: the request becomes a
chat completion request, served by ``OpenAIServingChat``, and its answer (or its stream of
chunks) is translated into a Response object (or the Responses stream events:
response.created ... response.output_text.delta ... response.completed). Function tools map
onto chat's tools; the answer's tool calls become ``function_call`` output items (streamed as
response.output_item.added, response.function_call_arguments.delta / .done,
response.output_item.done)."""
from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterable, Callable
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmtower.server.protocol_chat import ChatCompletionResponse
from llmtower.server.protocol_responses import (
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputReasoning,
    OutputText,
    ReasoningText,
    ResponsesRequest,
    ResponsesResponse,
    ResponseUsage,
)
from llmtower.server.serving_chat import OpenAIServingChat
from llmtower.server.tool_parsers.base import make_tool_call_id


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


Item = OutputReasoning | OutputMessage | OutputFunctionCall


def _output_items(message: Any, status: Literal["completed", "incomplete"]) -> list[Item]:
    """A chat answer's message as output items: its thinking (--reasoning-parser) as a
    reasoning item, its text as a message (left out when the model called functions and wrote
    nothing else but whitespace), then one item per call."""
    calls = message.tool_calls or []
    text = message.content or ""
    items: list[Item] = []
    reasoning = getattr(message, "reasoning_content", None)
    if reasoning:
        items.append(OutputReasoning(status=status, content=[ReasoningText(text=reasoning)]))
    if not calls or text.strip():
        items.append(OutputMessage(status=status, content=[OutputText(text=text)]))
    items += [OutputFunctionCall(call_id=c["id"], name=c["function"]["name"],
                                 arguments=c["function"]["arguments"], status=status)
              for c in calls]
    return items


class _StreamItems:
    """The output items of a streamed response as chat deltas build them, as Responses
    events: a message item opens on the first text that is not whitespace (or at the end when
    nothing else came), a function_call item on each call's first delta; the item before is
    done then. ``event`` formats one event (it numbers them)."""

    def __init__(self, event: Callable[..., str]) -> None:
        self.event = event
        self.items: list[Item] = []
        self.reasoning: OutputReasoning | None = None  # the open reasoning item
        self.message: OutputMessage | None = None  # the open message item
        self.text = ""  # its text so far
        self.pending = ""  # whitespace not sent yet, while no message is open
        self.call: OutputFunctionCall | None = None  # the open function_call item

    def _ids(self) -> dict[str, Any]:
        assert self.message is not None
        return {"item_id": self.message.id, "output_index": len(self.items) - 1,
                "content_index": 0}

    def _open_message(self) -> list[str]:
        self.message, self.text = OutputMessage(status="in_progress"), ""
        self.items.append(self.message)
        return [self.event("response.output_item.added", output_index=len(self.items) - 1,
                           item=self.message.model_dump(mode="json")),
                self.event("response.content_part.added", **self._ids(),
                           part={"type": "output_text", "text": "", "annotations": []})]

    def _close_message(self, status: str) -> list[str]:
        if self.message is None:
            return []
        message, ids, text = self.message, self._ids(), self.text
        message.status = status  # type: ignore[assignment]
        message.content = [OutputText(text=text)]
        self.message = None
        return [self.event("response.output_text.done", **ids, text=text, logprobs=[]),
                self.event("response.content_part.done", **ids,
                           part={"type": "output_text", "text": text, "annotations": []}),
                self.event("response.output_item.done", output_index=ids["output_index"],
                           item=message.model_dump(mode="json"))]

    def reasoning_delta(self, delta: str) -> list[str]:
        """Thinking: a reasoning item (one reasoning_text part) opens on the first delta."""
        out = []
        if self.reasoning is None:
            self.reasoning = OutputReasoning(status="in_progress")
            self.items.append(self.reasoning)
            out += [self.event("response.output_item.added", output_index=len(self.items) - 1,
                               item=self.reasoning.model_dump(mode="json")),
                    self.event("response.content_part.added", **self._reasoning_ids(),
                               part={"type": "reasoning_text", "text": ""})]
            self.reasoning.content = [ReasoningText(text="")]
        self.reasoning.content[0].text += delta
        return out + [self.event("response.reasoning_text.delta", **self._reasoning_ids(),
                                 delta=delta)]

    def _reasoning_ids(self) -> dict[str, Any]:
        assert self.reasoning is not None
        return {"item_id": self.reasoning.id, "output_index": self.items.index(self.reasoning),
                "content_index": 0}

    def _close_reasoning(self, status: str) -> list[str]:
        if self.reasoning is None:
            return []
        item, ids = self.reasoning, self._reasoning_ids()
        item.status = status  # type: ignore[assignment]
        text = item.content[0].text
        self.reasoning = None
        return [self.event("response.reasoning_text.done", **ids, text=text),
                self.event("response.content_part.done", **ids,
                           part={"type": "reasoning_text", "text": text}),
                self.event("response.output_item.done", output_index=ids["output_index"],
                           item=item.model_dump(mode="json"))]

    def _close_call(self, status: str) -> list[str]:
        if self.call is None:
            return []
        call, index = self.call, self.items.index(self.call)
        call.status = status  # type: ignore[assignment]
        self.call = None
        return [self.event("response.function_call_arguments.done", item_id=call.id,
                           output_index=index, arguments=call.arguments),
                self.event("response.output_item.done", output_index=index,
                           item=call.model_dump(mode="json"))]

    def _send(self, delta: str) -> list[str]:
        self.text += delta
        return [self.event("response.output_text.delta", **self._ids(), delta=delta,
                           logprobs=[])]

    def text_delta(self, delta: str) -> list[str]:
        out = self._close_call("completed")
        if delta.strip():
            out += self._close_reasoning("completed")
        if self.message is None:
            self.pending += delta
            if not self.pending.strip():
                return out
            delta, self.pending = self.pending, ""
            out += self._open_message()
        return out + self._send(delta)

    def call_delta(self, tool_call: dict[str, Any]) -> list[str]:
        fn = tool_call.get("function") or {}
        out = []
        if tool_call.get("id") is not None or self.call is None:  # a new call
            out = (self._close_reasoning("completed") + self._close_message("completed")
                   + self._close_call("completed"))
            self.pending = ""
            self.call = OutputFunctionCall(call_id=tool_call.get("id") or make_tool_call_id(),
                                           name=fn.get("name") or "", status="in_progress")
            self.items.append(self.call)
            out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                  item=self.call.model_dump(mode="json")))
        if fn.get("arguments"):
            self.call.arguments += fn["arguments"]
            out.append(self.event("response.function_call_arguments.delta", item_id=self.call.id,
                                  output_index=len(self.items) - 1, delta=fn["arguments"]))
        return out

    def finish(self, status: str) -> list[str]:
        """Close what is open; an answer with no item at all gets its (empty) message."""
        out = self._close_call(status)
        out += self._close_reasoning(status)  # open: cut off, or nothing followed it
        if self.message is None and not any(isinstance(i, OutputMessage | OutputFunctionCall)
                                            for i in self.items):
            out += self._open_message()
            if self.pending:
                out += self._send(self.pending)
        return out + self._close_message(status)


class OpenAIServingResponses:
    """Owns /v1/responses: the translation between Responses and chat completions."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _shell(self, req: ResponsesRequest) -> ResponsesResponse:
        out = ResponsesResponse(model=self.chat.model_name, instructions=req.instructions,
                                max_output_tokens=req.max_output_tokens,
                                temperature=req.temperature, top_p=req.top_p,
                                metadata=req.metadata,
                                parallel_tool_calls=req.parallel_tool_calls is not False)
        if req.tools:  # the tools and the choice, as the request sent them
            out.tools = [{k: v for k, v in t.items() if v is not None} for t in req.tools]
            out.tool_choice = req.tool_choice if req.tool_choice is not None else "auto"
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
        out.output = _output_items(choice.message, out.status)
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
        yield event("response.created", response=response.model_dump(mode="json"))
        yield event("response.in_progress", response=response.model_dump(mode="json"))
        items = _StreamItems(event)
        finish, usage = None, None
        async for raw_chunk in chunks:
            data = (raw_chunk.decode() if isinstance(raw_chunk, bytes) else raw_chunk).strip()
            if not data.startswith("data: ") or data == "data: [DONE]":
                continue
            chunk = json.loads(data[len("data: "):])
            if "error" in chunk:  # the chat stream failed after it started
                response.status = "failed"
                response.error = {"code": chunk["error"].get("code") or "server_error",
                                  "message": chunk["error"].get("message", "")}
                response.output = items.items
                yield event("response.failed", response=response.model_dump(mode="json"))
                return
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices", []):
                delta = choice.get("delta") or {}
                for out in (items.reasoning_delta(delta["reasoning_content"])
                            if delta.get("reasoning_content") else []):
                    yield out
                for out in (items.text_delta(delta["content"]) if delta.get("content") else []):
                    yield out
                for tool_call in delta.get("tool_calls") or []:
                    for out in items.call_delta(tool_call):
                        yield out
                finish = choice.get("finish_reason") or finish
        status: Literal["completed", "incomplete"] = (
            "incomplete" if finish == "length" else "completed")
        for out in items.finish(status):
            yield out
        response.status = status
        response.incomplete_details = _incomplete(finish)
        response.output = items.items
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
