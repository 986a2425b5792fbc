"""Small helpers every part shares, kept out of any one part's package: ceiling division
(block counts) and the on-disk cache directory (converted GGUF models, built kernels)."""
from __future__ import annotations

import os
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0): e.g. the blocks that ``a`` tokens fill."""
    return -(-a // b)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/llmtower``, or ``~/.cache/llmtower`` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmtower"
