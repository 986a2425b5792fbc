"""`llmtower bench throughput|serve`: each benchmark lives in llmtower.bench.<name> and exposes
`add_cli_args(parser)` and `run(args) -> int`."""
from __future__ import annotations

import importlib

BENCHMARKS = {
    "throughput": "offline throughput of the in-process engine (like `vllm bench throughput`)",
    "serve": "online serving benchmark against an OpenAI-compatible server (like `vllm bench serve`)",
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: throughput, serve")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    for name, help_ in BENCHMARKS.items():
        bp = bsub.add_parser(name, help=help_)
        try:
            mod = importlib.import_module(f"llmtower.bench.{name}")
        except ImportError:
            bp.set_defaults(handler=lambda _args, n=name: _missing(n))
            continue
        mod.add_cli_args(bp)
        bp.set_defaults(handler=mod.run)


def _missing(name: str) -> int:
    import sys
    print(f"llmtower bench {name} is not built yet", file=sys.stderr)
    return 1
