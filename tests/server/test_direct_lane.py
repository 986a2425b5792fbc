"""The direct lane (server/direct_lane.py): plain streamed tokens written to the client's
socket from the output handler's call. Under a real uvicorn server (httptools, the server
llmtower runs) the lane's events arrive between the stream's own, in order, in valid chunked
framing; it steps aside for finished outputs, a paused socket, a gone client and any server
whose ``send`` it does not know; and through `llmtower serve` streamed text and usage equal
the non-streamed answer for completions and chat."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from llmtower.engine.request_output import CompletionOutput, RequestOutput
from llmtower.server.direct_lane import DirectLane, DirectWriter
from llmtower.server.sse_response import DirectBodySend, SSEResponse


def _output(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(0, text, [7], None, None,
                                                           "length" if finished else None,
                                                           None)], finished, None, 0, None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_lane_events_arrive_between_the_streams_own_in_order_under_uvicorn():
    results: dict = {}

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        lane = DirectLane()
        lane.encode = lambda ro: f"data: {ro.outputs[0].text}\n\n".encode()
        handed_over = asyncio.Event()

        async def events():
            yield b"data: first\n\n"
            await handed_over.wait()  # the stream task waits on its box meanwhile
            yield b"data: last\n\n"

        async def handler():  # the output handler's side
            while lane.writer is None:
                await asyncio.sleep(0.01)
            results["taken"] = [lane.deliver(_output(t)) for t in ("a", "b", "c")]
            results["finished_taken"] = lane.deliver(_output("end", finished=True))
            results["error_taken"] = lane.deliver(ValueError("engine dead"))
            handed_over.set()

        task = asyncio.ensure_future(handler())
        await SSEResponse(events(), lane)(scope, receive, send)
        await task
        results["writer_after_end"] = lane.writer

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(DirectBodySend(app), host="127.0.0.1", port=port,
                                           http="httptools", log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 30
        while not server.started and time.time() < deadline:
            time.sleep(0.05)
        body = httpx.get(f"http://127.0.0.1:{port}/", timeout=30).text
    finally:
        server.should_exit = True
        thread.join(30)
    assert body == "data: first\n\ndata: a\n\ndata: b\n\ndata: c\n\ndata: last\n\n"
    assert results["taken"] == [True, True, True]
    # the end of a stream (usage, metrics) and errors take the ordinary way
    assert results["finished_taken"] is False and results["error_taken"] is False
    assert results["writer_after_end"] is None  # nothing written after the stream ended


class _Flow:
    write_paused = False


class _Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def is_closing(self) -> bool:
        return self.closing

    def write(self, data: bytes) -> None:
        self.written.append(data)


def _cycle() -> tuple[RequestResponseCycle, _Transport]:
    cycle = object.__new__(RequestResponseCycle)  # uvicorn's own class, its state set by hand
    transport = _Transport()
    cycle.transport, cycle.flow = transport, _Flow()
    cycle.disconnected, cycle.response_started, cycle.response_complete = False, True, False
    cycle.chunked_encoding = True
    return cycle, transport


@pytest.mark.parametrize("state", ["write_paused", "disconnected", "closing", "complete",
                                   "not_started"])
def test_the_lane_steps_aside_when_the_socket_cannot_take_a_write_now(state):
    """A client that reads slowly (flow control paused), one that has gone, or a response not
    started or already over: the output goes to the stream task, and the encoder (which
    counts tokens) is not even called."""
    cycle, transport = _cycle()
    if state == "write_paused":
        cycle.flow.write_paused = True
    elif state == "disconnected":
        cycle.disconnected = True
    elif state == "closing":
        transport.closing = True
    elif state == "complete":
        cycle.response_complete = True
    else:
        cycle.response_started = False
    lane = DirectLane()
    lane.writer = DirectWriter.of(cycle.send)
    calls: list[RequestOutput] = []
    lane.encode = lambda ro: calls.append(ro) or b"data: x\n\n"
    assert lane.deliver(_output("x")) is False
    assert calls == [] and transport.written == []


def test_a_ready_socket_gets_the_chunk_framed_as_uvicorn_frames_it():
    cycle, transport = _cycle()
    lane = DirectLane()
    lane.writer = DirectWriter.of(cycle.send)
    lane.encode = lambda ro: f"data: {ro.outputs[0].text}\n\n".encode()
    assert lane.deliver(_output("hi")) is True
    assert transport.written == [b"a\r\ndata: hi\n\n\r\n"]  # 10 bytes
    # an output with nothing to show (an incomplete character) is taken, writing nothing
    lane.encode = lambda _ro: b""
    assert lane.deliver(_output("")) is True and len(transport.written) == 1
    # an encoder that finds the output not plain leaves it to the stream task
    lane.encode = lambda _ro: None
    assert lane.deliver(_output("x")) is False


def test_other_servers_and_wrapped_sends_get_no_lane():
    async def plain_send(message):
        pass

    cycle, _ = _cycle()

    async def wrapper(message):  # a middleware's wrapper around uvicorn's send
        await cycle.send(message)

    assert DirectWriter.of(plain_send) is None and DirectWriter.of(wrapper) is None
    assert DirectWriter.of(cycle.send) is not None


def _stream_text(base_url: str, path: str, body: dict) -> tuple[str, list, dict, bool]:
    text, finishes, usage, done = "", [], {}, False
    with httpx.stream("POST", base_url + path, json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            d = json.loads(line[6:])
            usage = d.get("usage") or usage
            for ch in d["choices"]:
                text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                finishes.append(ch["finish_reason"])
    return text, finishes, usage, done


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_plain_streams_through_the_server_say_what_the_whole_answer_says(tiny_server, path):
    """Concurrent plain streams (their middle tokens on the lane): the joined text equals the
    non-streamed answer, one finish at the end, the usage counts every token, [DONE] last."""
    from server_args import MODEL
    base = {"model": MODEL, "max_tokens": 24, "temperature": 0, "ignore_eos": True}

    def body(i: int) -> dict:
        if path == "/v1/completions":
            return {**base, "prompt": f"count to {i}"}
        return {**base, "messages": [{"role": "user", "content": f"count to {i}"}]}

    def whole(i: int) -> str:
        r = httpx.post(tiny_server.base_url + path, json=body(i), timeout=120).json()
        ch = r["choices"][0]
        return ch["text"] if "text" in ch else ch["message"]["content"]

    expected = [whole(i) for i in range(6)]
    results: list = [None] * 6

    def run(i: int) -> None:
        results[i] = _stream_text(tiny_server.base_url, path,
                                  {**body(i), "stream": True,
                                   "stream_options": {"include_usage": True}})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, (text, finishes, usage, done) in enumerate(results):
        assert text == expected[i]
        assert [f for f in finishes if f is not None] == ["length"] and finishes[-1] == "length"
        assert usage["completion_tokens"] == 24 and done
