"""ASGI middleware that guards every request before it reaches a handler: the Host
allow-list (403), the API key (401) and the body size limit (413). Plain ASGI rather than Starlette's BaseHTTPMiddleware,
which would buffer streaming responses."""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Sequence
import json
import time

from llmtower.server.errors import error_body

# Paths served without an API key: probes and scrapers must not need the secret.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/ping", "/load",
                          "/docs", "/openapi.json"})


async def _send_error(send, status: int, message: str, code: str,
                      extra_headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Owns the API keys: every non-public path needs ``Authorization: Bearer <key>`` with
    one of them."""

    def __init__(self, app, api_key: str | list[str],
                 public_paths: frozenset[str] = PUBLIC_PATHS) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        self._expected = [f"Bearer {k}".encode() for k in keys]
        self.public_paths = public_paths

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in self.public_paths:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        # Every key is compared (no early exit), so timing says nothing about which matched.
        if not sum(hmac.compare_digest(got, e) for e in self._expected):
            return await _send_error(
                send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' with "
                "the key the server was started with (--api-key)", "invalid_api_key",
                [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


def host_of(header: bytes) -> str:
    """The host name of a Host header, without its port: 'a.b:80' -> 'a.b', '[::1]:80' -> '::1'."""
    host = header.decode("latin-1").strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host[1:]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


class HostAllowListMiddleware:
    """Owns the Host-header allow-list (--allowed-hosts): a request for any other host name is
    refused, so a web page whose DNS name was rebound to this server cannot call it."""

    def __init__(self, app, allowed_hosts: list[str]) -> None:
        self.app = app
        self.allowed = frozenset(h.strip().lower().strip("[]") for h in allowed_hosts)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or "*" in self.allowed:
            return await self.app(scope, receive, send)
        header = dict(scope["headers"]).get(b"host", b"")
        if host_of(header) not in self.allowed:
            shown = header.decode("latin-1")[:100]
            return await _send_error(
                send, 403, f"the Host header {shown!r} is not one this server answers to "
                "(--allowed-hosts)", "host_not_allowed")
        return await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


# Reading the rest of a refused body lets the client read the 413 (closing a socket with
# unread data resets it); past these bounds the connection is closed instead.
MAX_DRAIN_BYTES = 64 * 2**20
MAX_DRAIN_S = 5.0


async def _drain_body(receive, max_bytes: int = MAX_DRAIN_BYTES,
                      max_seconds: float = MAX_DRAIN_S) -> bool:
    """Read and drop the rest of a request body; True when all of it was read in bounds."""
    deadline = time.monotonic() + max_seconds
    drained = 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return False
        if message["type"] != "http.request":
            return False  # the client went away
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return True
        if drained > max_bytes:
            return False


class BodySizeLimitMiddleware:
    """Owns the body size limit: refuses a declared Content-Length over it at once, and
    stops reading a chunked body as soon as it passes the limit."""

    def __init__(self, app, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            # A client that waits for "100 Continue" has not sent the body: answer at once.
            # Otherwise the body is on its way: drain it (bounded) so the 413 is read.
            waiting = headers.get(b"expect", b"").lower() == b"100-continue"
            drained = (not waiting and int(declared) <= MAX_DRAIN_BYTES
                       and await _drain_body(receive))
            return await self._refuse(send, int(declared), keep_alive=waiting or drained)
        received = 0
        exceeded = refused = False

        async def limited_receive():
            nonlocal received, exceeded
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    exceeded = True
                    raise _BodyTooLarge
            return message

        async def guarded_send(message):
            # The app may turn the failed read into its own error response: replace it.
            nonlocal refused
            if not exceeded:
                return await send(message)
            if not refused:
                refused = True
                drained = await _drain_body(receive)
                await self._refuse(send, received, keep_alive=drained)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not refused:
                refused = True
                drained = await _drain_body(receive)
                await self._refuse(send, received, keep_alive=drained)

    async def _refuse(self, send, size: int, keep_alive: bool = True) -> None:
        await _send_error(send, 413, f"the request body ({size} bytes or more) is larger than "
                          f"the server's limit of {self.max_body_bytes} bytes "
                          "(--max-request-body-bytes)", "request_too_large",
                          [] if keep_alive else [(b"connection", b"close")])


class RequestIdHeaderMiddleware:
    """Owns the ``X-Request-Id`` response header: the id a generation endpoint gave the
    request (``cmpl-...``, ``chatcmpl-...``, with the client's own id inside when it sent
    one), as the endpoint noted it in ``request.state.request_id``. The openai SDK shows it
    as ``request_id`` / ``_request_id``; the access log names requests by the same id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                request_id = (scope.get("state") or {}).get("request_id")
                if request_id:
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (b"x-request-id", request_id.encode())]}
            await send(message)

        return await self.app(scope, receive, send_with_id)
