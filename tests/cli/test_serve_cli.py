"""`llmtower serve` command line: every option documented, defaults that bind locally."""
from __future__ import annotations

import argparse

from llmtower.cli.main import build_parser


def _serve_parser() -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices["serve"]


def test_every_serve_option_has_a_help_line():
    p = _serve_parser()
    options = [a for a in p._actions if a.option_strings and a.dest != "help"]
    assert {"--model", "--host", "--port", "--api-key", "--request-timeout",
            "--max-request-body-bytes", "--max-num-seqs", "--kv-cache-memory",
            "--max-num-queued-reqs", "--max-num-queued-tokens"} <= {
                s for a in options for s in a.option_strings}
    for action in options:
        assert action.help and len(action.help) > 10, action.option_strings


def test_serve_binds_to_localhost_by_default():
    args = _serve_parser().parse_args([])
    assert args.host == "127.0.0.1" and args.port == 8000
    assert args.api_key is None and args.request_timeout is None
