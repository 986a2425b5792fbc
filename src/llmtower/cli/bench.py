"""`llmtower bench` (not built yet: see the open issues)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("bench", help="bench (not built yet)")
    p.set_defaults(handler=_run)


def _run(args) -> int:
    print("llmtower bench is not built yet", file=sys.stderr)
    return 1
