"""Compiles llmtower's C kernels on first use and caches the shared library.

The kernels are plain C files next to this one (no PyTorch headers, so a build takes well
under a second). Each is compiled with the system C compiler (``$CC``, else ``cc``) for this
very CPU (``-march=native``) into ``$XDG_CACHE_HOME/llmtower/kernels/<name>-<key>.so``, where
the key hashes the source, the headers beside it (``bf16.h``), the flags, the compiler and
the CPU's feature flags; then loaded with ``ctypes``. Where there is no compiler or the build
fails, ``load`` raises ``KernelUnavailable`` with the compiler's message, and callers fall back
to PyTorch.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from llmtower.utils import cache_root

HERE = Path(__file__).resolve().parent
# -fopenmp: threads from the OpenMP runtime PyTorch already loaded, and `#pragma omp simd`;
# -fno-math-errno lets expf vectorize. No -ffast-math: the results stay IEEE float32.
FLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC", "-shared"]
NATIVE = ["-march=native"]


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no C compiler, or it failed)."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise KernelUnavailable(f"no C compiler: {cc!r} is not on PATH (install gcc, or set CC)")
    return cc


def _compile(cc: str, src: Path, out: Path) -> None:
    errors = []
    for flags in (NATIVE + FLAGS, FLAGS):  # -march=native is not known to every compiler
        cmd = [cc, *flags, str(src), "-o", str(out), "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise KernelUnavailable(f"{' '.join(cmd)} failed: {e}") from e
        if r.returncode == 0:
            return
        errors.append(f"{' '.join(cmd)}:\n{r.stderr.strip()}")
    raise KernelUnavailable("the C compiler failed:\n" + "\n".join(errors))


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The shared library of kernel ``<name>.c``, compiled on first use."""
    src = HERE / f"{name}.c"
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    headers = [h.read_text() for h in sorted(HERE.glob("*.h"))]  # what the sources include
    key = hashlib.sha256("\0".join(
        [src.read_text(), *headers, " ".join(NATIVE + FLAGS), version, _cpu_flags()]
    ).encode()).hexdigest()[:16]
    cache = cache_root() / "kernels"
    lib = cache / f"{name}-{key}.so"
    if not lib.exists():
        try:
            cache.mkdir(parents=True, exist_ok=True)
            # Compiled under a temporary name, then renamed: processes starting together (tests,
            # data-parallel engines) never load a half-written library.
            fd, tmp = tempfile.mkstemp(prefix=f".{name}-", suffix=".so", dir=cache)
            os.close(fd)
        except OSError as e:
            raise KernelUnavailable(f"cannot write the kernel cache in {cache} ({e}): set "
                                    "XDG_CACHE_HOME to a writable directory") from e
        try:
            _compile(cc, src, Path(tmp))
            os.replace(tmp, lib)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {lib}: {e}") from e
