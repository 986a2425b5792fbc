"""`llmtower serve` (not built yet: see the open issues)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve (not built yet)")
    p.set_defaults(handler=_run)


def _run(args) -> int:
    print("llmtower serve is not built yet", file=sys.stderr)
    return 1
