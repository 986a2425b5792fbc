"""`llmtower serve [MODEL]`: the OpenAI-compatible HTTP server over one or more engine
processes. Flags follow vLLM's names where vLLM has the setting (its spellings are accepted
as aliases where ours differ), and ``--config FILE`` reads any of them from YAML."""
from __future__ import annotations

import argparse

from llmtower.engine.args import EngineArgs

# The model of `llmtower serve MODEL` (vLLM's positional form), kept apart from --model so
# that giving both can be refused instead of one silently winning.
_MODEL_TAG = "model_tag"


def _positive_float(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a number of seconds > 0")
    return value


def add_cli_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(_MODEL_TAG, nargs="?", default=None, metavar="MODEL",
                   help="the model to serve, as vLLM's `serve MODEL` (same as --model)")
    p.add_argument("--config", default=None, metavar="FILE",
                   help="a YAML file of flags (e.g. 'max-num-seqs: 64'); flags given on the "
                   "command line win over it")
    http = p.add_argument_group("http server")
    http.add_argument("--host", default="127.0.0.1",
                      help="address to bind; 0.0.0.0 listens on all interfaces (needed in a "
                      "container) and exposes the server to the network (default: 127.0.0.1)")
    http.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    http.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                      help="require 'Authorization: Bearer <key>' with one of these keys on every "
                      "/v1 request and on /tokenize, /detokenize (default: no key)")
    http.add_argument("--request-timeout", type=_positive_float, default=None,
                      help="seconds a request may wait in the queue before its first token; "
                      "past that it is aborted with HTTP 408 (default: no timeout)")
    http.add_argument("--max-request-body-bytes", type=int, default=10 * 2**20,
                      help="largest accepted request body; larger ones get HTTP 413 "
                      "(default: 10485760)")
    http.add_argument("--chat-template", default=None, metavar="FILE_OR_STRING",
                      help="Jinja chat template (a file, or the template itself) used instead "
                      "of the tokenizer's; needed to chat with a model that has none")
    _add_guard_args(p)
    _add_tool_args(p)
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"],
                      help="server log level (default: info)")
    logs.add_argument("--uvicorn-log-level", default=None,
                      choices=["debug", "info", "warning", "error", "critical", "trace"],
                      help="uvicorn's own log level (default: --log-level)")
    logs.add_argument("--enable-log-requests", action="store_true",
                      help="log one line per request: method, route, status, latency and tokens "
                      "(never the prompt text, see --max-log-len)")
    logs.add_argument("--max-log-len", type=int, default=0, metavar="CHARS",
                      help="with --enable-log-requests, also log up to this many characters of "
                      "each prompt (default: 0, no prompt text)")
    logs.add_argument("--disable-log-stats", action="store_true",
                      help="no periodic throughput / KV-cache log lines")
    EngineArgs.add_cli_args(p)


_THREADS_EPILOG = """threads:
  By default (--num-threads 0) the engine uses the CPUs this process may use (taskset,
  cpuset, cgroup CPU quota) and sheds threads while other processes are runnable on them,
  taking them back when they leave: a busy neighbour costs a fair share, not a collapse.
  --num-threads N fixes the count (no shedding: for cores that are the engine's alone);
  --cpu-bind auto|LIST (or $LLMTOWER_CPU_OMP_THREADS_BIND) pins one thread per CPU.
  OMP_WAIT_POLICY / GOMP_SPINCOUNT are obeyed when set. See docs/performance.md."""


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API "
                       "(/v1/completions, /v1/chat/completions,\n/v1/responses, /v1/models, "
                       "/metrics, ...).", epilog=_THREADS_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_cli_args(p)
    p.set_defaults(handler=run)


def resolve_model(args: argparse.Namespace, parser_default: str) -> None:
    """Fold the positional MODEL into --model; both at once must agree."""
    tag = getattr(args, _MODEL_TAG, None)
    if tag is None:
        return
    if args.model != parser_default and args.model != tag:
        raise ValueError(f"the model is given twice ({tag!r} and --model {args.model!r}): "
                         "give it once")
    args.model = tag


def run(args: argparse.Namespace) -> int:
    from llmtower.engine.args import DEFAULT_MODEL
    from llmtower.engine.input_processor import resolve_chat_template
    from llmtower.server.api_server import ServerSettings, run_server  # heavy imports

    resolve_model(args, DEFAULT_MODEL)
    if args.headless:  # this host runs engines only; the head serves the API
        from llmtower.distributed.headless import run_headless
        return run_headless(EngineArgs.from_cli_args(args))
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              request_timeout=args.request_timeout,
                              max_request_body_bytes=args.max_request_body_bytes,
                              log_level=args.log_level,
                              uvicorn_log_level=args.uvicorn_log_level or args.log_level,
                              chat_template=resolve_chat_template(args.chat_template),
                              enable_log_requests=args.enable_log_requests,
                              max_log_len=args.max_log_len,
                              log_stats=not args.disable_log_stats,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser,
                              **_guard_settings(args))
    return run_server(EngineArgs.from_cli_args(args), settings)


def _add_tool_args(p: argparse.ArgumentParser) -> None:
    """Tool calling (vLLM's flags; see docs/structured_outputs.md)."""
    g = p.add_argument_group("tool calling")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="allow tool_choice=\"auto\" (the default when a request sends tools): "
                   "the model decides, --tool-call-parser finds its calls")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="the model's tool-call format: hermes (<tool_call>{...}</tool_call>, "
                   "Qwen2.5 / SmolLM2 style) or llama3_json")


def _add_guard_args(p: argparse.ArgumentParser) -> None:
    """Request limits, access control and shutdown (issue 11)."""
    g = p.add_argument_group("limits, access and shutdown")
    g.add_argument("--max-n", type=int, default=16, metavar="N",
                   help="most samples one request may ask for (n, best_of); more is HTTP 400 "
                   "(default: 16)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, how long requests in flight may run on before "
                   "they are aborted (new ones get HTTP 503 at once) (default: 30)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="let a request bring its own chat template (chat_template); a template "
                   "is code the server runs, so this is off by default")
    g.add_argument("--metrics-require-auth", action="store_true",
                   help="serve /metrics only with the API key (needs --api-key)")
    g.add_argument("--allowed-hosts", nargs="+", default=None, metavar="HOST",
                   help="answer only requests whose Host header names one of these hosts "
                   "(e.g. localhost 127.0.0.1), against DNS rebinding (default: any host)")
    g.add_argument("--expose-model-path", action="store_true",
                   help="show the model's path on disk as `root` in /v1/models (default: the "
                   "served model name)")


def _guard_settings(args: argparse.Namespace) -> dict:
    return {"max_n": args.max_n, "shutdown_timeout": args.shutdown_timeout,
            "trust_request_chat_template": args.trust_request_chat_template,
            "metrics_require_auth": args.metrics_require_auth,
            "allowed_hosts": args.allowed_hosts, "expose_model_path": args.expose_model_path}
