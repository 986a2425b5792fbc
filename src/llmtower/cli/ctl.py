"""`llmtower ctl`: operator actions on a running server.

- ``ctl defrag``: a full KV-cache defragmentation now (each request's block table and the
  free space become one run each); prints the moves made and fragmentation before / after.
- ``ctl unpin``: release the prefix blocks pinned by ``llmtower preload --pin``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable

from llmtower.cli.admin_http import AdminError, add_server_args, post


def register(sub) -> None:
    p = sub.add_parser("ctl", help="operator actions on a running server: defrag, unpin")
    csub = p.add_subparsers(dest="ctl_command", required=True)
    d = csub.add_parser("defrag", help="defragment the KV cache now",
                        description="Move KV blocks so that every request's block table and "
                        "the free space are one run each; requests in flight keep running.")
    add_server_args(d)
    d.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    d.set_defaults(handler=run_defrag)
    u = csub.add_parser("unpin", help="release the prefix blocks pinned by `preload --pin`")
    add_server_args(u, timeout_default=15.0)
    u.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    u.set_defaults(handler=run_unpin)


def run_defrag(args: argparse.Namespace) -> int:
    def line(r: dict) -> str:
        return (f"engine {r['engine_index']}: {r['num_moves']} block moves; fragmentation "
                f"{r['fragmentation_before']:.3f} -> {r['fragmentation_after']:.3f} "
                f"(free space {r['free_fragmentation_before']:.3f} -> "
                f"{r['free_fragmentation_after']:.3f}, block tables "
                f"{r['table_fragmentation_before']:.3f} -> {r['table_fragmentation_after']:.3f})")
    return _run(args, "defrag", line)


def run_unpin(args: argparse.Namespace) -> int:
    return _run(args, "unpin",
                lambda r: f"engine {r['engine_index']}: {r['num_unpinned']} blocks unpinned")


def _run(args: argparse.Namespace, action: str, line: Callable[[dict], str]) -> int:
    """POST the action; print the answer as JSON (--json) or one line per engine."""
    try:
        res = post(args.url, action, args.api_key, args.timeout, {"engine_id": args.engine_id})
    except AdminError as e:
        print(f"llmtower ctl {action}: error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
        return 0
    for r in res["engines"]:
        print(line(r))
    return 0
