"""`llmtower serve`: the OpenAI-compatible HTTP server over one engine process."""
from __future__ import annotations

import argparse

from llmtower.engine.args import EngineArgs


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    http = p.add_argument_group("http server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind; 0.0.0.0 exposes the server to the network "
                      "(default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--api-key", default=None,
                      help="require 'Authorization: Bearer <key>' on every /v1 request and on "
                      "/tokenize, /detokenize (default: no key)")
    http.add_argument("--request-timeout", type=_positive_float, default=None,
                      help="seconds a request may wait in the queue before its first token; "
                      "past that it is aborted with HTTP 408 (default: no timeout)")
    http.add_argument("--max-request-body-bytes", type=int, default=10 * 2**20,
                      help="largest accepted request body; larger ones get HTTP 413 "
                      "(default: 10485760)")
    http.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"],
                      help="server log level (default: info)")
    EngineArgs.add_cli_args(p)


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API "
                       "(/v1/completions, /v1/chat/completions, /v1/models, /metrics, ...).")
    add_cli_args(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from llmtower.server.api_server import ServerSettings, run_server  # heavy imports

    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              request_timeout=args.request_timeout,
                              max_request_body_bytes=args.max_request_body_bytes,
                              log_level=args.log_level)
    return run_server(EngineArgs.from_cli_args(args), settings)
