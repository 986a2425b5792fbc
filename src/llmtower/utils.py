"""Small helpers every part shares, kept out of any one part's package: ceiling division
(block counts), the on-disk cache directory (converted GGUF models, built kernels) and what
/proc/cpuinfo says about this CPU (the kernels' build key and capabilities, the bfloat16 hint,
the simulator's profile name)."""
from __future__ import annotations

import functools
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0): e.g. the blocks that ``a`` tokens fill."""
    return -(-a // b)


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/llmtower``, or ``~/.cache/llmtower`` when XDG_CACHE_HOME is unset."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "llmtower"


def cache_tmpdir(root: Path, prefix: str, what: str) -> Path:
    """A fresh private directory in ``root`` (created if need be) to build ``what`` in before
    it is renamed into place, so that processes starting together never see half of it.
    Raises OSError saying what to change where ``root`` is not writable."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    except OSError as e:
        raise OSError(f"cannot write the {what} cache in {root} ({e}): set XDG_CACHE_HOME to a "
                      "writable directory") from e


@dataclass(frozen=True)
class CpuInfo:
    """What /proc/cpuinfo says about the first CPU: its model name and feature flags (lower
    case, e.g. ``avx512_bf16``; x86's ``flags`` line, Arm's ``Features``). Empty where the file
    cannot be read (not Linux)."""

    model_name: str = ""
    flags: frozenset[str] = frozenset()


@functools.cache
def cpu_info() -> CpuInfo:
    """This machine's ``CpuInfo``, read once per process."""
    name, flags = "", ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not name:
                    name = value.strip()
                elif key in ("flags", "Features") and not flags:
                    flags = value
                if name and flags:
                    break
    except OSError:
        pass
    return CpuInfo(name, frozenset(flags.split()))
