"""`llmtower ctl`: operator actions on a running server.

- ``ctl defrag``: a full KV-cache defragmentation now (each request's block table and the
  free space become one run each); prints the moves made and fragmentation before / after.
- ``ctl unpin``: release the prefix blocks pinned by ``llmtower preload --pin``.
- ``ctl drain --engine-id N [--wait]``: stop routing to data-parallel engine N, move its
  un-started requests to the others, let its running ones finish (``--wait``: until it holds
  nothing, so that its host can be stopped without dropping a request).
- ``ctl undrain --engine-id N``: route to engine N again (after its host was replaced).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable

from llmtower.cli.admin_http import DEFAULT_URL, AdminError, add_server_args, get, post


def register(sub) -> None:
    p = sub.add_parser("ctl", help="operator actions on a running server: defrag, unpin, "
                       "drain, undrain")
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
    dr = csub.add_parser("drain", help="stop routing to one data-parallel engine, let it empty",
                         description="Stop routing new requests to engine N, move its requests "
                         "that have not started to the other engines and let its running ones "
                         "finish; with --wait, return once it holds nothing (safe to stop its "
                         "host). It stays out of routing until `llmtower ctl undrain`.")
    _add_engine_args(dr)
    dr.add_argument("--wait", action="store_true",
                    help="wait until the engine holds no request (up to --timeout seconds)")
    dr.set_defaults(handler=run_drain)
    ud = csub.add_parser("undrain", help="route to a drained data-parallel engine again")
    _add_engine_args(ud)
    ud.set_defaults(handler=run_undrain)


def _add_engine_args(p) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help=f"server address (default: {DEFAULT_URL})")
    p.add_argument("--api-key", default=None, help="the server's --api-key, if it has one")
    p.add_argument("--engine-id", type=int, required=True,
                   help="the index of the data-parallel engine (see GET /v1/admin/data_parallel)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the server, and with --wait for the drain "
                   "(default: 300)")
    p.add_argument("--json", action="store_true", help="print the server's answer as JSON")


def _drain_line(st: dict) -> str:
    e = st["engine_index"]
    if not st["draining"]:
        return f"engine {e}: serving (not draining)"
    if st["drained"]:
        return (f"engine {e}: drained ({st['moved']} un-started request(s) moved to other "
                "engines); it can be stopped; `llmtower ctl undrain --engine-id "
                f"{e}` routes to it again")
    return (f"engine {e}: draining, {st['in_flight']} running request(s) left to finish "
            f"({st['moved']} un-started moved to other engines)")


def run_drain(args: argparse.Namespace) -> int:
    params = {"engine_id": str(args.engine_id)}
    deadline = time.monotonic() + args.timeout
    try:
        st = post(args.url, "drain", args.api_key, args.timeout, params)
        while args.wait and not st["drained"]:
            if time.monotonic() > deadline:
                print(f"llmtower ctl drain: error: engine {args.engine_id} still holds "
                      f"{st['in_flight']} request(s) after {args.timeout:g} s (--timeout); it "
                      "keeps draining", file=sys.stderr)
                return 1
            time.sleep(0.25)
            view = json.loads(get(args.url, "data_parallel", args.api_key, args.timeout))
            st = view["draining"].get(str(args.engine_id)) or st
            if not view["draining"].get(str(args.engine_id)):
                print(f"llmtower ctl drain: error: engine {args.engine_id} was undrained "
                      "meanwhile", file=sys.stderr)
                return 1
    except AdminError as e:
        print(f"llmtower ctl drain: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st) if args.json else _drain_line(st))
    return 0


def run_undrain(args: argparse.Namespace) -> int:
    try:
        st = post(args.url, "undrain", args.api_key, args.timeout,
                  {"engine_id": str(args.engine_id)})
    except AdminError as e:
        print(f"llmtower ctl undrain: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(st) if args.json else _drain_line(st))
    return 0


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
