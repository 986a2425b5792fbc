"""SSEResponse: a stream's events reach the client in order; under DirectBodySend (the app
uvicorn runs) they skip the middleware's send wrappers while the status line still passes
every middleware; a client that hangs up cancels the events' generator (which is what
aborts the request in the engine)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI

from llmtower.server.sse_response import DirectBodySend, SSEResponse


class CountingMiddleware:
    """Notes the type of every message sent through it."""

    def __init__(self, app, seen: list[str]) -> None:
        self.app = app
        self.seen = seen

    async def __call__(self, scope, receive, send):
        async def counting_send(message):
            self.seen.append(message["type"])
            if message["type"] == "http.response.start":  # a middleware adding a header
                message = {**message, "headers": [*message["headers"], (b"x-seen", b"1")]}
            await send(message)

        await self.app(scope, receive, counting_send)


def _app(events: list[str | bytes], closed: list[bool], hang: asyncio.Event | None = None):
    app = FastAPI()
    seen: list[str] = []

    async def gen():
        try:
            for e in events:
                yield e
            if hang is not None:
                await hang.wait()  # a stream that waits for its next token
        finally:
            closed.append(True)

    @app.post("/s")
    async def s():
        return SSEResponse(gen())

    app.add_middleware(CountingMiddleware, seen=seen)
    return app, seen


async def _call(app, disconnect: asyncio.Event | None = None):
    sent: list[dict] = []
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
             "http_version": "1.1", "method": "POST", "path": "/s", "raw_path": b"/s",
             "root_path": "", "scheme": "http", "query_string": b"", "headers": [],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "state": {}}
    requested = False

    async def receive():
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": b"", "more_body": False}
        if disconnect is None:
            await asyncio.Event().wait()
        await disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)
        if disconnect is not None and message.get("body"):
            disconnect.set()  # the client hangs up after the first event

    await app(scope, receive, send)
    return sent


def test_events_in_order_past_the_middleware():
    closed: list[bool] = []
    app, seen = _app([b"data: 1\n\n", "data: 2\n\n", b"data: [DONE]\n\n"], closed)
    sent = asyncio.run(_call(DirectBodySend(app)))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert (b"x-seen", b"1") in sent[0]["headers"]  # the status line went through it
    assert [m["body"] for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n",
                                             b"data: [DONE]\n\n", b""]
    assert sent[-1]["more_body"] is False
    assert seen == ["http.response.start"]  # the events did not
    assert closed == [True]


def test_without_direct_send_the_events_take_the_ordinary_send():
    closed: list[bool] = []
    app, seen = _app([b"data: 1\n\n"], closed)
    sent = asyncio.run(_call(app))
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b""]
    assert seen == ["http.response.start", "http.response.body", "http.response.body"]


def test_a_client_that_hangs_up_closes_the_generator():
    async def run():
        closed: list[bool] = []
        app, _ = _app([b"data: 1\n\n"], closed, hang=asyncio.Event())
        sent = await asyncio.wait_for(_call(DirectBodySend(app), asyncio.Event()), 5)
        return sent, closed

    sent, closed = asyncio.run(run())
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n"]  # no end: the client left
    assert closed == [True]
