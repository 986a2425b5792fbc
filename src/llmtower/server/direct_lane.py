"""The direct lane: a plain streamed token written to its client by the output handler, in the
step's one pass, instead of waking the request's stream task.

At saturation every stream gets one output per engine step. The ordinary way
(output handler -> OutputBox -> the stream task wakes -> AsyncLLM.generate -> merge_streams
-> the endpoint's _stream -> SSEResponse -> uvicorn's send -> the socket) runs a task switch
and five coroutine frames per token per stream. For the tokens in the middle of a plain
stream (n = 1, no logprobs, echo, token ids or per-chunk usage: most streamed tokens) the
lane does the endpoint's encoding and the socket write in the handler's call:

    output handler --put_nowait--> OutputBox --sink--> DirectLane.deliver
                                       |                  | encode (the endpoint's own
                                       |                  |   function) + transport.write
                                       v                  v
    (anything else: first output, last   the client's socket, in order
     output, errors, a full socket)
    stream task, as before

Order is kept because the box offers an item to its sink only while the stream task waits on
an empty box (everything before has been sent), and the lane writes only while the socket
takes writes without waiting (uvicorn's flow control not paused). Anything else takes the
ordinary way: the first output (the status line goes first), the finished one (usage, metrics
and the end of the stream), a disconnected client (the stream task is being cancelled), and
servers other than uvicorn's httptools protocol, whose ``send`` the lane recognises.

The lane writes past uvicorn's ``send`` for body chunks only: the same chunked-encoding
frame that ``send`` writes, while ``send`` still starts and ends the response, so uvicorn's
own state (started, complete, keep-alive) stays right.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmtower.engine.request_output import RequestOutput

logger = logging.getLogger(__name__)

# An endpoint's encoder: the SSE events of one plain output, or None when the output is not
# plain (it then takes the ordinary way, and the encoder must have changed nothing).
Encoder = Callable[[RequestOutput], bytes | None]


class DirectWriter:
    """Owns nothing but a reference to one uvicorn (httptools) response cycle, and writes
    response body chunks to its socket when that needs no waiting."""

    __slots__ = ("_cycle", "_transport")

    def __init__(self, cycle: Any) -> None:
        self._cycle = cycle
        self._transport = cycle.transport

    @classmethod
    def of(cls, send: Any) -> DirectWriter | None:
        """The writer behind an ASGI ``send``, where it is uvicorn's httptools response
        cycle (the server llmtower runs); None for any other server."""
        cycle = getattr(send, "__self__", None)
        if type(cycle).__name__ != "RequestResponseCycle" or not type(cycle).__module__.endswith(
                "httptools_impl"):
            return None
        if not all(hasattr(cycle, a) for a in ("transport", "flow", "disconnected",
                                                "response_started", "response_complete",
                                                "chunked_encoding")):
            return None
        return cls(cycle)

    def ready(self) -> bool:
        """Whether a body chunk can be written now: the response has started (chunked) and is
        not over, the client is there, and uvicorn's flow control is not holding writes back
        (the client reads too slowly)."""
        c = self._cycle
        return not (c.disconnected or not c.response_started or c.response_complete
                    or not c.chunked_encoding or c.flow.write_paused
                    or self._transport.is_closing())

    def write(self, body: bytes) -> None:
        """One chunk of the response body, framed as uvicorn's ``send`` frames it."""
        self._transport.write(b"%x\r\n%b\r\n" % (len(body), body))


class DirectLane:
    """Owns one plain stream's direct lane: the writer (set by SSEResponse once the status
    line is out) and the encoder (set by the endpoint's stream, which shares its counters
    with it). ``deliver`` is the request's OutputBox sink."""

    __slots__ = ("writer", "encode")

    def __init__(self) -> None:
        self.writer: DirectWriter | None = None
        self.encode: Encoder | None = None

    def deliver(self, item: Any) -> bool:
        """Write ``item`` now, or return False for the stream task to handle it."""
        writer, encode = self.writer, self.encode
        if (writer is None or encode is None or type(item) is not RequestOutput
                or item.finished):
            return False
        try:
            if not writer.ready():  # checked first: the encoder counts what it encodes
                return False
            body = encode(item)
            if body is None:
                return False
            if body:
                writer.write(body)
            return True
        except Exception:  # a bug here must not take the output handler (every stream) down
            logger.exception("the direct lane failed; this stream goes the ordinary way")
            self.writer = None
            return False
