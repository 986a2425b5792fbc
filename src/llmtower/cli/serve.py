"""`llmtower serve [MODEL]`: the OpenAI-compatible HTTP server over one or more engine
processes. Flags follow vLLM's names where vLLM has the setting (its spellings are accepted
as aliases where ours differ), and ``--config FILE`` reads any of them from YAML."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

from llmtower.engine.args import EngineArgs

if TYPE_CHECKING:
    from llmtower.server.frontend_options import FrontendOptions

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
    _add_frontend_args(p)
    logs = p.add_argument_group("logging")
    logs.add_argument("--log-level", default="info",
                      choices=["debug", "info", "warning", "error"],
                      help="server log level (default: info)")
    logs.add_argument("--uvicorn-log-level", default=None,
                      choices=["debug", "info", "warning", "error", "critical", "trace"],
                      help="uvicorn's own log level (default: --log-level)")
    logs.add_argument("--enable-log-requests", action=argparse.BooleanOptionalAction,
                      default=False,
                      help="log one line per request: method, route, status, latency and tokens "
                      "(never the prompt text, see --max-log-len) (default: off)")
    logs.add_argument("--disable-log-requests", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="vLLM's older spelling of --no-enable-log-requests (request "
                      "logging is off unless --enable-log-requests)")
    logs.add_argument("--disable-uvicorn-access-log", action=argparse.BooleanOptionalAction,
                      default=None,
                      help="vLLM's switch for uvicorn's own access log, which this server never "
                      "writes: accepted; --no-disable-uvicorn-access-log is refused "
                      "(--enable-log-requests writes one line per request instead)")
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
        from llmtower.engine.headless import run_headless
        return run_headless(EngineArgs.from_cli_args(args))
    settings = ServerSettings(host=args.host, port=args.port, api_key=args.api_key,
                              request_timeout=args.request_timeout,
                              max_request_body_bytes=args.max_request_body_bytes,
                              log_level=args.log_level,
                              uvicorn_log_level=args.uvicorn_log_level or args.log_level,
                              chat_template=resolve_chat_template(args.chat_template),
                              enable_log_requests=log_requests(args),
                              max_log_len=args.max_log_len,
                              log_stats=not args.disable_log_stats,
                              enable_auto_tool_choice=args.enable_auto_tool_choice,
                              tool_call_parser=args.tool_call_parser,
                              reasoning_parser=args.reasoning_parser,
                              frontend=frontend_options(args),
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
    g.add_argument("--reasoning-parser", default=None,
                   choices=["deepseek_r1", "qwen3", "openai_gptoss"],
                   help="split a thinking model's reasoning off into the answer's "
                   "reasoning_content: deepseek_r1 (the start tag may be in the prompt: text "
                   "up to </think> is reasoning), qwen3 (reasoning only after <think>) or "
                   "openai_gptoss (harmony's analysis channel; the default for gpt-oss models)")


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


def log_requests(args: argparse.Namespace) -> bool:
    """--enable-log-requests, with vLLM's older --disable-log-requests spelling."""
    if args.disable_log_requests is None:
        return bool(args.enable_log_requests)
    if args.disable_log_requests and args.enable_log_requests:
        raise ValueError("--enable-log-requests and --disable-log-requests contradict each "
                         "other: give one")
    return not args.disable_log_requests


def _json_or_words(values: list | None) -> list[str] | None:
    """vLLM's --allowed-origins '["https://a"]' (a JSON list) or plain words (a b)."""
    if values is None:
        return None
    out: list[str] = []
    for value in values:
        text = value.strip() if isinstance(value, str) else value
        if isinstance(text, str) and text.startswith("["):
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"cannot read {value!r} as a JSON list: {e}") from None
            if not isinstance(parsed, list) or not all(isinstance(v, str) for v in parsed):
                raise ValueError(f"{value!r} must be a JSON list of strings")
            out.extend(parsed)
        else:
            out.append(str(text))
    return out


def _add_frontend_args(p: argparse.ArgumentParser) -> None:
    """vLLM's frontend flags (server/frontend_options.py)."""
    g = p.add_argument_group("vLLM frontend flags")
    g.add_argument("--allowed-origins", nargs="+", default=None, metavar="ORIGIN",
                   help="answer browsers' CORS requests from these origins: words "
                   "(https://app.example.com) or vLLM's JSON list ('[\"*\"]'); unlike vLLM, "
                   "no CORS headers are sent without it (default: none)")
    g.add_argument("--allowed-methods", nargs="+", default=None, metavar="METHOD",
                   help="with --allowed-origins: the methods allowed (default: all)")
    g.add_argument("--allowed-headers", nargs="+", default=None, metavar="HEADER",
                   help="with --allowed-origins: the request headers allowed (default: all)")
    g.add_argument("--allow-credentials", action=argparse.BooleanOptionalAction, default=False,
                   help="with --allowed-origins: allow credentialed CORS requests (default: off)")
    g.add_argument("--enable-request-id-headers", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="every response carries X-Request-Id (the generation endpoints always "
                   "do): the request's own X-Request-Id, else a random id (default: off)")
    g.add_argument("--enable-force-include-usage", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="every streamed completion and chat ends with its usage chunk, as if "
                   "it sent stream_options.include_usage=true (default: off)")
    g.add_argument("--reject-unknown-fields", action=argparse.BooleanOptionalAction,
                   default=False,
                   help="answer a request carrying fields this server does not know with "
                   "HTTP 400 naming them; by default they are ignored with a warning in the "
                   "log, as vLLM does (default: off)")
    g.add_argument("--enable-prompt-tokens-details", action=argparse.BooleanOptionalAction,
                   default=None,
                   help="vLLM's switch for usage.prompt_tokens_details (cached_tokens), which "
                   "this server always sends: accepted; the --no- form is refused")
    g.add_argument("--response-role", default="assistant",
                   help="the role of the chat reply; only 'assistant' here (default: assistant)")
    g.add_argument("--root-path", default=None, metavar="PATH",
                   help="the path prefix a path-routing proxy serves this server under (e.g. "
                   "/llm); /docs and /openapi.json then name it (default: none)")
    g.add_argument("--disable-fastapi-docs", action=argparse.BooleanOptionalAction,
                   default=False, help="no /docs page and no /openapi.json (default: off)")
    g.add_argument("--ssl-keyfile", default=None, metavar="FILE",
                   help="serve HTTPS with this private key (needs --ssl-certfile)")
    g.add_argument("--ssl-certfile", default=None, metavar="FILE",
                   help="serve HTTPS with this certificate (needs --ssl-keyfile)")
    g.add_argument("--ssl-ca-certs", default=None, metavar="FILE",
                   help="CA certificates that client certificates are checked against")
    g.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                   help="client certificates: 0 not asked, 1 optional, 2 required (Python's "
                   "ssl.CERT_*) (default: 0)")


def frontend_options(args: argparse.Namespace) -> FrontendOptions:
    from llmtower.server.frontend_options import FrontendOptions

    if args.disable_uvicorn_access_log is False:
        raise ValueError("--no-disable-uvicorn-access-log: this server has no uvicorn access "
                         "log; use --enable-log-requests for one line per request")
    if args.enable_prompt_tokens_details is False:
        raise ValueError("--no-enable-prompt-tokens-details: this server always sends "
                         "usage.prompt_tokens_details (its cached_tokens); leave the flag out")
    if args.response_role != "assistant":
        raise ValueError(f"--response-role {args.response_role!r} is not supported: chat "
                         "replies always have the role 'assistant' here; leave it out")
    return FrontendOptions(
        allowed_origins=_json_or_words(args.allowed_origins),
        allowed_methods=_json_or_words(args.allowed_methods),
        allowed_headers=_json_or_words(args.allowed_headers),
        allow_credentials=args.allow_credentials,
        enable_request_id_headers=args.enable_request_id_headers,
        enable_force_include_usage=args.enable_force_include_usage,
        reject_unknown_fields=args.reject_unknown_fields,
        root_path=args.root_path, disable_fastapi_docs=args.disable_fastapi_docs,
        ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs, ssl_cert_reqs=args.ssl_cert_reqs)
