"""The access log of ``--enable-log-requests``: one line per HTTP request, written when its
last byte is sent (streams included): method, path, status, latency, prompt and completion
tokens, and the request id.

The endpoints note their token counts with ``note_tokens`` on the record of the request being
served, found through a context variable; so the middleware needs no knowledge of any route.
Prompt text is logged only when the operator asks (``--max-log-len`` > 0), cut to that length.
"""
from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass

from llmtower.metrics.http import StatusWatch

logger = logging.getLogger("llmtower.access")


@dataclass
class AccessRecord:
    """What one request's log line says beyond what the middleware sees itself."""

    request_id: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_text: str | None = None


_current: contextvars.ContextVar[AccessRecord | None] = contextvars.ContextVar(
    "llmtower_access_record", default=None)


def note_tokens(request_id: str, prompt_tokens: int, completion_tokens: int) -> None:
    """Record the token counts of the request being served (no-op without the access log)."""
    record = _current.get()
    if record is not None:
        record.request_id = request_id
        record.prompt_tokens = prompt_tokens
        record.completion_tokens = completion_tokens


def note_prompt(text: str | None) -> None:
    """Record the prompt text; the middleware logs it only if --max-log-len allows."""
    record = _current.get()
    if record is not None and text is not None:
        record.prompt_text = text


class AccessLogMiddleware:
    """Owns the access log: times each HTTP request and logs its line when it ends."""

    def __init__(self, app, max_log_len: int = 0) -> None:
        self.app = app
        self.max_log_len = max_log_len

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        record = AccessRecord()
        token = _current.set(record)
        start = time.perf_counter()
        watch = StatusWatch(send, 0)  # 0: logged as 499, the client left before an answer
        try:
            await self.app(scope, receive, watch)
        finally:
            _current.reset(token)
            self._log(scope, watch.status, time.perf_counter() - start, record)

    def _log(self, scope, status: int, seconds: float, record: AccessRecord) -> None:
        client = scope.get("client")
        line = (f"{client[0] if client else '-'} \"{scope['method']} {scope['path']}\" "
                f"{status or 499} {seconds * 1e3:.1f}ms")
        if record.request_id is not None:
            line += (f" prompt_tokens={record.prompt_tokens} "
                     f"completion_tokens={record.completion_tokens} id={record.request_id}")
        if self.max_log_len > 0 and record.prompt_text is not None:
            line += f" prompt={record.prompt_text[:self.max_log_len]!r}"
        logger.info("%s", line)
