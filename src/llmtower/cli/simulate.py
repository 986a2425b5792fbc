"""`llmtower simulate` (not built yet: see the open issues)."""
from __future__ import annotations

import sys


def register(sub) -> None:
    p = sub.add_parser("simulate", help="simulate (not built yet)")
    p.set_defaults(handler=_run)


def _run(args) -> int:
    print("llmtower simulate is not built yet", file=sys.stderr)
    return 1
