"""`llmtower` command line: one subcommand module per job, each with a `register(subparsers)`."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules under llmtower.cli; each registers its own parser(s) and handler(s).
SUBCOMMAND_MODULES = ["serve", "generate", "bench", "simulate", "diag", "monitor", "ctl", "preload"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llmtower", description="LLM inference and serving engine with an iteration-level scheduler")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMAND_MODULES:
        importlib.import_module(f"llmtower.cli.{name}").register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if getattr(args, "config", None):
            # Flags from the YAML file become defaults; the command line is read again over them.
            from llmtower.cli.config_file import apply_config_file
            apply_config_file(_subparser(parser, args.command), args.config)
            args = parser.parse_args(argv)
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, FileNotFoundError) as e:
        print(f"llmtower {args.command}: error: {e}", file=sys.stderr)
        return 2


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


if __name__ == "__main__":
    sys.exit(main())
