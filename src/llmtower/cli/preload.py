"""`llmtower preload --prompts-file FILE [--pin]`: compute the KV of known prompts (system
prompts, few-shot headers) into a running server's prefix cache, so that the first request
sharing one finds it cached. The file holds one prompt per line, or JSONL with 'prompt' or
'messages' (see ``engine/preload_file.py``). Bad lines are reported with their number and
the others are still preloaded (exit status 1 then)."""
from __future__ import annotations

import argparse
import json
import sys

from llmtower.cli.admin_http import AdminError, add_server_args, post
from llmtower.engine.preload_file import read_prompts_file


def register(sub) -> None:
    p = sub.add_parser("preload", help="preload prompts into a running server's prefix cache",
                       description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--prompts-file", required=True, metavar="FILE",
                   help="one prompt per line, or JSONL objects with 'prompt' or 'messages'")
    p.add_argument("--pin", action="store_true",
                   help="keep the preloaded blocks out of eviction (up to the server's "
                   "--max-pinned-blocks) until `llmtower ctl unpin`")
    p.add_argument("--cache-salt", default=None,
                   help="the cache salt of the requests that should share these prefixes")
    add_server_args(p, timeout_default=600.0)
    p.add_argument("--json", action="store_true", help="print the server's answer as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    try:
        pf = read_prompts_file(args.prompts_file)
    except (FileNotFoundError, ValueError) as e:
        print(f"llmtower preload: error: {e}", file=sys.stderr)
        return 2
    for err in pf.errors:
        print(f"llmtower preload: error: {err} (skipped)", file=sys.stderr)
    if not pf.items:
        print("llmtower preload: error: no prompt of the file could be read", file=sys.stderr)
        return 2
    body = {"prompts": [it.to_json() for it in pf.items], "pin": args.pin,
            "engine_id": args.engine_id, "cache_salt": args.cache_salt}
    try:
        res = post(args.url, "preload", args.api_key, args.timeout, json=body)
    except AdminError as e:
        print(f"llmtower preload: error: {e}", file=sys.stderr)
        return 1
    for bad in res["errors"]:
        line = pf.items[bad["index"]].line
        print(f"llmtower preload: error: {args.prompts_file}:{line}: {bad['message']} (skipped)",
              file=sys.stderr)
    if args.json:
        print(json.dumps(res))
    else:
        for st in res["engines"]:
            print(f"engine {st['engine_index']}: preloaded {st['num_done']} of "
                  f"{len(pf.items)} prompt(s), {st['num_cached_blocks']} blocks cached, "
                  f"{st['num_pinned_blocks']} newly pinned ({st['total_pinned_blocks']} of "
                  f"{st['max_pinned_blocks']} pinned)")
    return 1 if (pf.errors or res["errors"]) else 0
