"""The OpenAI-compatible HTTP server: the FastAPI app factory and the uvicorn runner.

``build_app(llm, settings)`` assembles the middleware and the routers (each endpoint's router
lives beside its handler: ``serving_*.py``, ``admin.py``) over one started ``AsyncLLM``;
``serve(args)`` starts the engine, then uvicorn, in one event loop, and shuts everything down on
exit.
"""
from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
from collections.abc import Coroutine, Generator
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI

import llmtower
from llmtower.engine.args import EngineArgs
from llmtower.engine.async_llm import AsyncLLM
from llmtower.engine.core_client import EngineStartupError
from llmtower.engine.core_proc import EngineFactory, default_engine_factory
from llmtower.metrics.http import HTTPMetricsMiddleware
from llmtower.lora.serving_args import runtime_updating_allowed
from llmtower.server.lora_routes import build_lora_router
from llmtower.server.access_log import AccessLogMiddleware
from llmtower.server.admin import build_admin_router
from llmtower.server.admin_memory import preload_at_start
from llmtower.server.errors import install_exception_handlers
from llmtower.server.frontend_options import (
    FrontendOptions,
    fastapi_kwargs,
    install_frontend_middleware,
    uvicorn_kwargs,
)
from llmtower.server.limits import RequestLimits
from llmtower.server.middleware import (
    PUBLIC_PATHS,
    APIKeyMiddleware,
    BodySizeLimitMiddleware,
    HostAllowListMiddleware,
    RequestIdHeaderMiddleware,
)
from llmtower.server.reasoning import default_reasoning_parser, get_reasoning_parser
from llmtower.server.serving_chat import OpenAIServingChat, build_chat_router
from llmtower.server.serving_completions import OpenAIServingCompletion, build_completions_router
from llmtower.server.serving_models import build_models_router
from llmtower.server.serving_probes import build_probe_router
from llmtower.server.serving_responses import build_responses_router
from llmtower.server.serving_tokenization import build_tokenization_router
from llmtower.server.sse_response import DirectBodySend
from llmtower.server.shutdown import DrainMiddleware, DrainState, GracefulShutdown
from llmtower.server.tool_parsers.tool_choice import ToolSettings

logger = logging.getLogger(__name__)

# An engine that got a SIGTERM with this server (a signal to the whole process group) waits
# for the drain (--shutdown-timeout) and the stop after it, plus this, before it exits alone.
ENGINE_STOP_MARGIN_S = 15.0


@dataclass
class ServerSettings:
    """Owns the HTTP-side settings of ``llmtower serve`` (the engine's are in EngineArgs)."""

    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | list[str] | None = None  # several keys: any of them is accepted
    request_timeout: float | None = None
    max_request_body_bytes: int = 10 * 2**20
    log_level: str = "info"
    uvicorn_log_level: str | None = None  # None: log_level
    chat_template: str | None = None  # --chat-template, already read from its file
    enable_log_requests: bool = False  # the access log
    max_log_len: int = 0  # prompt characters in the access log (0: none)
    log_stats: bool = True  # the periodic throughput line (--disable-log-stats)
    # Hostile-input and shutdown settings (issue 11).
    max_n: int = 16  # most samples (n, best_of) per request
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM / Ctrl-C
    trust_request_chat_template: bool = False  # may a request bring its own chat template
    metrics_require_auth: bool = False  # /metrics behind the API key
    allowed_hosts: list[str] | None = None  # Host-header allow-list (None: any host)
    expose_model_path: bool = False  # /v1/models `root` = the model's path, not its name
    # Tool calling (issue 12): tool_choice="auto" needs both.
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    # --reasoning-parser: the thinking in reasoning_content (None: no split).
    reasoning_parser: str | None = None
    # vLLM's frontend flags: CORS, request-id headers, forced usage, root path, docs, TLS.
    frontend: FrontendOptions = field(default_factory=FrontendOptions)

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port={self.port} is invalid: use 0..65535")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"max_request_body_bytes={self.max_request_body_bytes} is "
                             "invalid: it must be >= 1")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout={self.request_timeout} is invalid: give "
                             "seconds > 0, or leave it out for no timeout")
        if self.max_n < 1:
            raise ValueError(f"max_n={self.max_n} is invalid: it must be >= 1")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout={self.shutdown_timeout} is invalid: give "
                             "seconds >= 0")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)  # an unknown name fails here
        if self.metrics_require_auth and not self.api_key:
            raise ValueError("metrics_require_auth needs an API key (--api-key)")


def build_app(llm: AsyncLLM, settings: ServerSettings) -> FastAPI:
    """The FastAPI app over a started ``AsyncLLM``: its middleware, then its routers."""
    # /docs: FastAPI's OpenAPI page over the request models (no key needed to read it).
    app = FastAPI(title="llmtower", version=llmtower.__version__,
                  **fastapi_kwargs(settings.frontend))
    app.state.llm = llm
    install_exception_handlers(app)
    install_middleware(app, llm, settings)
    limits = RequestLimits.for_model(
        llm.max_model_len, max_n=settings.max_n,
        trust_request_chat_template=settings.trust_request_chat_template)
    completions = OpenAIServingCompletion(llm, limits)
    # --reasoning-parser, else the one the model's own output format needs (gpt-oss).
    assert llm.ready is not None, "start() the AsyncLLM first"
    reasoning = settings.reasoning_parser or default_reasoning_parser(llm.ready.model_path)
    chat = OpenAIServingChat(llm, limits, ToolSettings(settings.enable_auto_tool_choice,
                                                        settings.tool_call_parser),
                             get_reasoning_parser(reasoning) if reasoning else None)
    # Routes are matched in order: the generation endpoints first, every request tried the
    # admin routes before them (a tenth of a millisecond per request at saturation).
    app.include_router(build_completions_router(completions, settings.frontend))
    app.include_router(build_chat_router(chat, settings.frontend))
    app.include_router(build_admin_router(llm))
    app.include_router(build_responses_router(chat))
    app.include_router(build_probe_router(llm))
    app.include_router(build_models_router(completions, settings.expose_model_path))
    app.include_router(build_tokenization_router(chat))
    if llm.engine_args.enable_lora and runtime_updating_allowed(
            llm.engine_args.enable_lora_runtime_updating):
        app.include_router(build_lora_router(llm))
    return app


def install_middleware(app: FastAPI, llm: AsyncLLM, settings: ServerSettings) -> None:
    """The middleware stack, innermost first (each one added wraps the ones before it)."""
    # Innermost: counts what is in flight for the graceful shutdown, refuses once draining.
    app.state.drain = DrainState()
    app.add_middleware(DrainMiddleware, state=app.state.drain)
    app.add_middleware(RequestIdHeaderMiddleware)
    # Added last = outermost: the size check runs before the key check reads anything.
    if settings.api_key:
        public = (PUBLIC_PATHS - {"/metrics"} if settings.metrics_require_auth
                  else PUBLIC_PATHS)
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key, public_paths=public)
    if settings.allowed_hosts:
        app.add_middleware(HostAllowListMiddleware, allowed_hosts=settings.allowed_hosts)
    app.add_middleware(BodySizeLimitMiddleware, max_body_bytes=settings.max_request_body_bytes)
    # Outermost: refused requests (401, 413) are counted and timed too.
    app.add_middleware(HTTPMetricsMiddleware, metrics=llm.metrics.http)
    if settings.enable_log_requests:
        app.add_middleware(AccessLogMiddleware, max_log_len=settings.max_log_len)
    install_frontend_middleware(app, settings.frontend)  # last: CORS is outermost


async def serve(engine_args: EngineArgs, settings: ServerSettings,
                engine_factory: EngineFactory = default_engine_factory) -> None:
    """Start the engine, then serve HTTP until SIGINT/SIGTERM (or cancellation); always
    stops the engine process on the way out."""
    # Bind before the engine loads the model: a busy port fails in a second, not a minute.
    sock = bind_socket(settings.host, settings.port)
    llm = AsyncLLM(engine_args, engine_factory=engine_factory,
                   request_timeout_s=settings.request_timeout,
                   chat_template=settings.chat_template, log_stats=settings.log_stats,
                   # A SIGTERM to the whole group must not kill the engine under the drain.
                   engine_sigterm_grace_s=settings.shutdown_timeout + ENGINE_STOP_MARGIN_S)
    loop = asyncio.get_running_loop()
    main_task = asyncio.current_task()
    # Our handlers, not uvicorn's: SIGTERM / Ctrl-C drain the server (shutdown.py); during
    # start-up they cancel it.
    drain = DrainState()
    shutdown = GracefulShutdown(drain, settings.shutdown_timeout, llm.abort_all)

    def cancel_start() -> None:
        if main_task is not None:
            main_task.cancel()

    shutdown.on_early_signal = cancel_start
    shutdown.install(loop)
    try:
        await llm.start()
        if engine_args.preload_prompts:  # before serving: the first requests find it cached
            await preload_at_start(llm, engine_args.preload_prompts, engine_args.preload_pin)
        app = build_app(llm, settings)
        shutdown.state = app.state.drain
        # Everything alive now (modules, tokenizer) lives as long as the server: keep it out
        # of the collector's reach, or every full collection walks it while serving.
        gc.collect()
        gc.freeze()
        # Each streamed token makes a few short-lived containers (outputs, chunks, futures);
        # at the default threshold of 700 the young generation was collected every few dozen
        # tokens, 3-5% of this process's CPU at saturation. Garbage without cycles goes at
        # once either way; this only makes the cycle search rarer.
        gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
        # Streamed events skip the middleware's send wrappers (sse_response.py).
        config = uvicorn.Config(DirectBodySend(app), host=settings.host, port=settings.port,
                                log_level=settings.uvicorn_log_level or settings.log_level,
                                access_log=False,
                                timeout_graceful_shutdown=5,
                                http="h11" if os.environ.get(EVENT_LOOP_ENV) == "asyncio" else "auto",
                                **uvicorn_kwargs(settings.frontend))
        server = _Server(config)
        shutdown.stop_server = server.request_exit
        logger.info("llmtower serving %s on %s://%s:%d", llm.model_name,
                    settings.frontend.scheme, settings.host, sock.getsockname()[1])
        if settings.host in ("127.0.0.1", "localhost", "::1"):
            logger.info("listening on this machine only; to accept other machines (or from "
                        "outside a container) start with --host 0.0.0.0 (and set --api-key)")
        await server.serve(sockets=[sock])
    finally:
        llm.shutdown()
        sock.close()
        GracefulShutdown.uninstall(loop)  # last: a signal while stopping changes nothing
    summary = shutdown.summary
    if summary is not None:
        logger.info("llmtower stopped on %s: %s; engine stopped", summary.signal_name,
                    summary.describe())


GC_YOUNG_THRESHOLD = 20_000  # allocations between collections of the youngest generation


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: GracefulShutdown decides when it exits."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield

    def request_exit(self) -> None:
        self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --port "
                         "or stop the process that uses it") from None
    return sock


# Which event loop and HTTP parser serve: "auto" takes uvloop and httptools where installed
# (uvicorn's own choice for its HTTP side), "asyncio" the standard library's loop and h11.
EVENT_LOOP_ENV = "LLMTOWER_EVENT_LOOP"


def run_event_loop(main: Coroutine[Any, Any, None]) -> None:
    """Run the server's coroutine on uvloop where installed (its transports write in C: the
    API process sends one SSE chunk per token per stream) unless $LLMTOWER_EVENT_LOOP=asyncio."""
    choice = os.environ.get(EVENT_LOOP_ENV, "auto")
    if choice not in ("auto", "asyncio"):
        raise ValueError(f"${EVENT_LOOP_ENV}={choice!r}: set 'auto' or 'asyncio', or unset it")
    if choice == "auto":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            return uvloop.run(main)
    asyncio.run(main)


def run_server(engine_args: EngineArgs, settings: ServerSettings) -> int:
    """Blocking entry point of ``llmtower serve``."""
    logging.basicConfig(level=getattr(logging, settings.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # SIGTERM (e.g. from a supervisor) shuts down like Ctrl-C; serve() installs the handlers
    # of both on its event loop, which drain in-flight requests first.
    try:
        run_event_loop(serve(engine_args, settings))
    except (KeyboardInterrupt, asyncio.CancelledError):  # stopped while starting
        logger.info("llmtower stopped during start-up; engine stopped")
    except EngineStartupError as e:  # its own error and traceback were logged above
        logger.error("%s", e)
        return 1
    return 0
