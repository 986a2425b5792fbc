"""ASGI middleware that guards every request before it reaches a handler: the API key
(401) and the body size limit (413). Plain ASGI rather than Starlette's BaseHTTPMiddleware,
which would buffer streaming responses."""
from __future__ import annotations

import hmac
import json

from llmtower.server.errors import error_body

# Paths served without an API key: probes and scrapers must not need the secret.
PUBLIC_PATHS = frozenset({"/health", "/ready", "/metrics", "/version"})


async def _send_error(send, status: int, message: str, code: str,
                      extra_headers: list[tuple[bytes, bytes]] = ()) -> None:
    body = json.dumps(error_body(status, message, code=code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *extra_headers]})
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Owns the API key: every non-public path needs ``Authorization: Bearer <key>``."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PUBLIC_PATHS:
            return await self.app(scope, receive, send)
        got = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(got, self._expected):
            return await _send_error(
                send, 401, "missing or wrong API key: send 'Authorization: Bearer <key>' with "
                "the key the server was started with (--api-key)", "invalid_api_key",
                [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


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
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return await self._refuse(send, int(declared))
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
                await self._refuse(send, received)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except _BodyTooLarge:
            if not refused:
                refused = True
                await self._refuse(send, received)

    async def _refuse(self, send, size: int) -> None:
        await _send_error(send, 413, f"the request body ({size} bytes or more) is larger than "
                          f"the server's limit of {self.max_body_bytes} bytes "
                          "(--max-request-body-bytes)", "request_too_large")
