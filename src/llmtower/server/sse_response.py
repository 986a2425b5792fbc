"""The streamed (SSE) response of the generation endpoints, with its events sent past the
middleware.

Starlette's StreamingResponse sends each event through every ASGI ``send`` wrapper of the
stack (Starlette's two exception layers, the request-id header, the body-size guard, the
HTTP metrics' status watch): five coroutine calls per token per stream, none of which looks
at a body message; and it runs each response in an anyio task group. Here the status line
and headers still go through the whole stack (so every middleware sees the status and adds
its headers), and the events go straight to the server's ``send``, which
``DirectBodySend`` (the app uvicorn runs) leaves in the scope. Without it (an app under
test, mounted elsewhere) the events take the ordinary ``send``.

So middleware of this app must not rewrite or count response bodies (none does: they look at
``http.response.start`` only); one that did would have to clear ``BODY_SEND``.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import StreamingResponse

from llmtower.server.direct_lane import DirectLane, DirectWriter

# The scope key of the server's own ``send`` (set by DirectBodySend).
BODY_SEND = "llmtower.body_send"


class DirectBodySend:
    """The ASGI app uvicorn runs: the FastAPI app, with the server's ``send`` left in each
    HTTP request's scope for ``SSEResponse``'s events."""

    def __init__(self, app: Any) -> None:
        self.app = app

    def __getattr__(self, name: str) -> Any:  # app.state, app.routes ... of the wrapped app
        return getattr(self.app, name)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[BODY_SEND] = send
        await self.app(scope, receive, send)


class SSEResponse(StreamingResponse):
    """Owns one ``text/event-stream`` response: its events (str or bytes) in order, then the
    end of the body; the client hanging up cancels the events' generator (which aborts the
    request in the engine)."""

    def __init__(self, events: AsyncIterator[str | bytes],
                 lane: DirectLane | None = None) -> None:
        super().__init__(events, media_type="text/event-stream")
        self.lane = lane  # where the stream has one: opened once the status line is out

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        body_send = scope.get(BODY_SEND) or send
        streamer = asyncio.ensure_future(self._send_events(send, body_send))
        listener = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait((streamer, listener), return_when=asyncio.FIRST_COMPLETED)
        finally:
            listener.cancel()
            if not streamer.done():  # the client left (or this task was cancelled)
                streamer.cancel()
                await asyncio.gather(streamer, return_exceptions=True)
        if not streamer.cancelled():
            streamer.result()  # an error while streaming is the app's error

    async def _send_events(self, send: Any, body_send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        charset = self.charset
        lane = self.lane
        if lane is not None:
            lane.writer = DirectWriter.of(body_send)
        try:
            async for event in self.body_iterator:
                body = event.encode(charset) if isinstance(event, str) else event
                await body_send({"type": "http.response.body", "body": body, "more_body": True})
        finally:
            if lane is not None:  # the end goes the ordinary way, and nothing after it
                lane.writer = None
        await body_send({"type": "http.response.body", "body": b"", "more_body": False})


async def _until_disconnect(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
