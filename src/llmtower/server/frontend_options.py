"""vLLM's frontend flags of ``vllm serve`` that shape the HTTP server rather than the engine:
CORS (``--allowed-origins`` ...), ``--enable-request-id-headers``,
``--enable-force-include-usage``, ``--reject-unknown-fields``, ``--root-path``, ``--disable-fastapi-docs`` and TLS
(``--ssl-keyfile`` ...). ``api_server`` calls the hooks below; everything else about these
flags lives here."""
from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI

from llmtower.server.protocol import StreamOptions
from llmtower.server.unknown_fields import RejectUnknownFieldsMiddleware


@dataclass
class FrontendOptions:
    """Owns the settings of the vLLM frontend flags (defaults: vLLM's, except CORS, off until
    --allowed-origins is given)."""

    allowed_origins: list[str] | None = None  # None: no CORS headers at all
    allowed_methods: list[str] | None = None  # None: ["*"]
    allowed_headers: list[str] | None = None  # None: ["*"]
    allow_credentials: bool = False
    enable_request_id_headers: bool = False
    enable_force_include_usage: bool = False
    root_path: str | None = None
    disable_fastapi_docs: bool = False
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: int = 0  # ssl.CERT_NONE
    reject_unknown_fields: bool = False  # unknown request fields: 400 instead of a warning

    def __post_init__(self) -> None:
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("TLS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile),
                           ("--ssl-certfile", self.ssl_certfile),
                           ("--ssl-ca-certs", self.ssl_ca_certs)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path}: no such file")
        if self.allow_credentials and self.allowed_origins and "*" in self.allowed_origins:
            raise ValueError("--allow-credentials with --allowed-origins '*' would let any web "
                             "page call this server with the user's credentials: name the "
                             "origins (e.g. --allowed-origins https://app.example.com)")
        if self.root_path is not None and self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"--root-path {self.root_path!r} must start with '/' (e.g. /llm)")

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile else "http"


def fastapi_kwargs(options: FrontendOptions) -> dict[str, Any]:
    """FastAPI(...)'s arguments: /docs and /openapi.json unless --disable-fastapi-docs, and
    --root-path (the prefix a path-routing proxy serves this app under)."""
    kwargs: dict[str, Any] = {"docs_url": "/docs", "redoc_url": None}
    if options.disable_fastapi_docs:
        kwargs.update(docs_url=None, openapi_url=None)
    if options.root_path:
        kwargs["root_path"] = options.root_path
    return kwargs


def install_frontend_middleware(app: FastAPI, options: FrontendOptions) -> None:
    """Call after every other middleware: CORS is then outermost, so a browser's preflight
    (OPTIONS, which carries no API key) is answered, and refusals carry CORS headers too."""
    if options.reject_unknown_fields:
        app.add_middleware(RejectUnknownFieldsMiddleware)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdForAllMiddleware)
    if options.allowed_origins:
        from starlette.middleware.cors import CORSMiddleware
        app.add_middleware(CORSMiddleware, allow_origins=options.allowed_origins,
                           allow_methods=options.allowed_methods or ["*"],
                           allow_headers=options.allowed_headers or ["*"],
                           allow_credentials=options.allow_credentials)


def uvicorn_kwargs(options: FrontendOptions) -> dict[str, Any]:
    """uvicorn.Config(...)'s TLS arguments (none without --ssl-certfile)."""
    if not options.ssl_certfile:
        return {}
    return {"ssl_keyfile": options.ssl_keyfile, "ssl_certfile": options.ssl_certfile,
            "ssl_ca_certs": options.ssl_ca_certs, "ssl_cert_reqs": options.ssl_cert_reqs}


def force_usage(body: Any, options: FrontendOptions) -> Any:
    """--enable-force-include-usage: a streamed completion or chat ends with its usage chunk,
    as if the client had sent ``stream_options.include_usage=true`` (a response that is not
    streamed always carries its usage)."""
    if options.enable_force_include_usage and getattr(body, "stream", False):
        if body.stream_options is None:
            body.stream_options = StreamOptions(include_usage=True)
        else:
            body.stream_options.include_usage = True
    return body


class RequestIdForAllMiddleware:
    """--enable-request-id-headers: every response carries ``X-Request-Id`` (vLLM's flag).
    The generation endpoints already send their response's id there; any other response
    (probes, /tokenize, errors before an id was given) gets the request's own ``X-Request-Id``
    header when it sent one, else a new random id."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"x-request-id")

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                if not any(k.lower() == b"x-request-id" for k, _ in headers):
                    headers.append((b"x-request-id", given or uuid.uuid4().hex.encode()))
                    message = {**message, "headers": headers}
            await send(message)

        return await self.app(scope, receive, send_with_id)
