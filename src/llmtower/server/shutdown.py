"""Graceful shutdown of ``llmtower serve`` on SIGTERM or Ctrl-C (SIGINT).

  1. Stop accepting: every new request gets 503 ``server_shutting_down`` in OpenAI's error
     shape (``/metrics`` still answers, so a last scrape sees the end).
  2. Drain: requests in flight run to their end, for up to ``--shutdown-timeout`` seconds.
  3. Abort what is left: each gets a proper error — a 503 body, or for a stream an SSE error
     event and ``data: [DONE]`` — and is aborted in the engine.
  4. Stop uvicorn, then the engine processes (``serve`` does that), and exit 0 with one log
     line.

A second signal skips the rest of the drain (step 3 at once). The signal handlers are the
event loop's, not uvicorn's, so uvicorn never cancels a handler mid-response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmtower.server.errors import error_body

logger = logging.getLogger("llmtower.server")

# Paths that still answer while draining.
DRAIN_OPEN_PATHS = frozenset({"/metrics"})
# After the aborts: how long the aborted responses get to reach their clients.
ABORT_FLUSH_S = 5.0


@dataclass
class DrainState:
    """Owns whether the server still accepts requests and how many HTTP requests are in
    flight (a streamed response counts until its last byte)."""

    accepting: bool = True
    active: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self._idle.set()

    def enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float | None, interrupt: asyncio.Event | None = None
                        ) -> bool:
        """Wait until nothing is in flight; False on timeout or when ``interrupt`` is set."""
        waits = [asyncio.ensure_future(self._idle.wait())]
        if interrupt is not None:
            waits.append(asyncio.ensure_future(interrupt.wait()))
        try:
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self._idle.is_set()


class DrainMiddleware:
    """Owns the in-flight count of a ``DrainState`` and refuses new requests once it stops
    accepting. Plain ASGI, so that a streamed response is counted until it ends."""

    def __init__(self, app: Any, state: DrainState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"] in DRAIN_OPEN_PATHS:
            return await self.app(scope, receive, send)
        if not self.state.accepting:
            body = json.dumps(error_body(
                503, "the server is shutting down and takes no new requests; retry on "
                "another replica or after it restarts", code="server_shutting_down")).encode()
            await send({"type": "http.response.start", "status": 503,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode()),
                                    (b"connection", b"close")]})
            await send({"type": "http.response.body", "body": body})
            return
        self.state.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.leave()


@dataclass
class ShutdownSummary:
    """What the shutdown did, for its one log line."""

    signal_name: str = ""
    drained: bool = True
    num_in_flight: int = 0
    num_aborted: int = 0
    seconds: float = 0.0

    def describe(self) -> str:
        if self.num_in_flight == 0:
            what = "no request in flight"
        elif self.drained:
            what = f"{self.num_in_flight} request(s) in flight finished"
        else:
            what = (f"{self.num_in_flight} request(s) in flight, {self.num_aborted} aborted at "
                    "the shutdown timeout")
        return f"{what} ({self.seconds:.1f} s)"


class GracefulShutdown:
    """Owns the sequence from the first SIGINT/SIGTERM to the moment uvicorn may exit:
    refuse, drain for ``timeout_s``, abort the rest through ``abort_all(reason) -> int``,
    then call ``stop_server()``."""

    def __init__(self, state: DrainState, timeout_s: float,
                 abort_all: Callable[[str], int]) -> None:
        self.state = state
        self.timeout_s = timeout_s
        self.abort_all = abort_all
        self.summary: ShutdownSummary | None = None
        self.stop_server: Callable[[], None] | None = None
        self.on_early_signal: Callable[[], None] | None = None
        self._force = asyncio.Event()
        self._task: asyncio.Task | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)

    @staticmethod
    def uninstall(loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    def on_signal(self, sig: int) -> None:
        if self.stop_server is None:  # still starting: nothing to drain
            if self.on_early_signal is not None:
                self.on_early_signal()
            return
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self.run(signal.Signals(sig).name))
        else:
            self._force.set()  # a second signal: stop waiting

    async def run(self, signal_name: str) -> ShutdownSummary:
        start = time.monotonic()
        state = self.state
        state.accepting = False
        # uvicorn's own shutdown chatter would bury our one line.
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
        summary = ShutdownSummary(signal_name=signal_name, num_in_flight=state.active)
        if state.active:
            logger.info("%s: taking no new requests; waiting up to %g s for %d in flight "
                        "(--shutdown-timeout)", signal_name, self.timeout_s, state.active)
        summary.drained = await state.wait_idle(self.timeout_s, self._force)
        if not summary.drained:
            summary.num_aborted = self.abort_all(
                f"the server is shutting down ({signal_name}); the request was aborted after "
                f"the {self.timeout_s:g} s shutdown timeout (--shutdown-timeout)")
            await state.wait_idle(ABORT_FLUSH_S)
        summary.seconds = time.monotonic() - start
        self.summary = summary
        if self.stop_server is not None:
            self.stop_server()
        return summary
