"""Small helpers every part shares, kept out of any one part's package: ceiling division
(block counts), reading a JSON config file, the on-disk cache directory (converted GGUF models, built kernels) and what
/proc/cpuinfo says about this CPU (the kernels' build key and capabilities, what --dtype auto picks,
the simulator's profile name)."""
from __future__ import annotations

import functools
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for integers (b > 0): e.g. the blocks that ``a`` tokens fill."""
    return -(-a // b)


def read_json_object(file: Path) -> dict:
    """The JSON object in ``file``; ValueError naming the file where it is not valid JSON or
    not an object (a config file someone edited by hand)."""
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected a JSON object, found {type(value).__name__}")
    return value


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


# /proc/cpuinfo flags of a CPU that multiplies bfloat16 natively: x86's AVX512-BF16 and AMX,
# Arm's BF16 extension (its ``Features`` line).
NATIVE_BFLOAT16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")

# Overrides what --dtype auto picks (float32 or bfloat16): the test suite sets float32, where
# exactness against transformers is the point, without pinning every engine it builds.
AUTO_DTYPE_ENV = "LLMTOWER_AUTO_DTYPE"


def onednn_isa_cap() -> str | None:
    """oneDNN's instruction-set cap when it stops below bfloat16 arithmetic (e.g. AVX2, the
    emulation of an AVX2-only CPU), else None."""
    cap = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "")
    cap = cap.strip().upper()
    if not cap or cap in ("ALL", "DEFAULT") or any(
            t in cap for t in ("BF16", "AMX", "FP16", "AVX10")):
        return None
    return cap


def auto_dtype(info: CpuInfo | None = None) -> tuple[str, str]:
    """What ``--dtype auto`` means on this machine, and why: bfloat16 where the CPU multiplies
    it natively (vLLM's CPU rule; ~1.6x the tokens of float32), float32 elsewhere (bfloat16
    would be emulated there, slower than float32)."""
    forced = os.environ.get(AUTO_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"${AUTO_DTYPE_ENV}={forced!r} is invalid: set float32 or "
                             "bfloat16, or unset it")
        return forced, f"${AUTO_DTYPE_ENV}={forced}"
    flags = (info or cpu_info()).flags
    native = [f for f in NATIVE_BFLOAT16_FLAGS if f in flags]
    cap = onednn_isa_cap()
    if native and cap is not None:
        return "float32", (f"oneDNN is capped below native bfloat16 (ONEDNN_MAX_CPU_ISA={cap}), "
                           "as on a CPU without it")
    if native:
        return "bfloat16", f"this CPU multiplies bfloat16 natively ({', '.join(native)})"
    return "float32", ("this CPU has no native bfloat16 (no avx512_bf16, amx_bf16 or Arm "
                       "bf16 flag in /proc/cpuinfo)")


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


def describe_dtype(dtype: str) -> str:
    """The model's dtype for the start-up line, with why where --dtype auto chose it."""
    if dtype != "auto":
        return f"{dtype} (--dtype {dtype})"
    chosen, why = auto_dtype()
    exact = ("; --dtype float32 is token-exact against transformers" if chosen == "bfloat16"
             else "")
    return f"{chosen} (--dtype auto: {why}{exact})"
