"""Compiles llmtower's C kernels into one shared library on first use and caches it.

The kernels are plain C files next to this one (no PyTorch headers). Every ``*.c`` here is
compiled to an object with the system C compiler (``$CC``, else ``cc``) for this very CPU
(``-march=native``), in parallel, and the objects are linked into ONE shared library,
``$XDG_CACHE_HOME/llmtower/kernels/llmtower_kernels-<key>.so``, where the key hashes every source
and header here, the flags, the compiler and the CPU's feature flags; it is then loaded once with
``ctypes``. One library means one copy of the state the headers share (the few-row tiles'
prefetch setting, the vector exp's check): no Python copying settings between libraries.

Where there is no compiler, or the build fails with ``-march=native`` and without it,
``library()`` raises ``KernelUnavailable`` with the compiler's message, and callers fall back to
PyTorch (``kernels/ops.py`` records the reason).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from llmtower.utils import cache_root, cache_tmpdir, cpu_info

HERE = Path(__file__).resolve().parent
NAME = "llmtower_kernels"
# -fopenmp: threads from the OpenMP runtime PyTorch already loaded, and `#pragma omp simd`;
# -fno-math-errno lets expf vectorize. No -ffast-math: the results stay IEEE float32.
CFLAGS = ["-O3", "-fopenmp", "-fno-math-errno", "-fPIC"]
LDFLAGS = ["-shared", "-fopenmp"]
NATIVE = ["-march=native"]


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no C compiler, or it failed)."""


def sources() -> list[Path]:
    """The C sources linked into the library, in a fixed order."""
    return sorted(HERE.glob("*.c"))


def _compiler() -> str:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        raise KernelUnavailable(f"no C compiler: {cc!r} is not on PATH (install gcc, or set CC)")
    return cc


def _run_all(cmds: list[list[str]]) -> list[str]:
    """Runs the commands side by side; the error text of each one that failed."""
    procs: list[subprocess.Popen[str]] = []
    cmd = cmds[0]
    try:
        for cmd in cmds:
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                          text=True))
        errors = []
        for cmd, p in zip(cmds, procs):
            _, err = p.communicate(timeout=300)
            if p.returncode != 0:
                errors.append(f"{' '.join(cmd)}:\n{err.strip()}")
        return errors
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{' '.join(cmd)} failed: {e}") from e
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _compile(cc: str, srcs: list[Path], out: Path, work: Path) -> None:
    errors: list[str] = []
    for arch in (NATIVE, []):  # -march=native is not known to every compiler
        objs = [work / f"{s.stem}.o" for s in srcs]
        failed = _run_all([[cc, *arch, *CFLAGS, "-c", str(s), "-o", str(o)]
                           for s, o in zip(srcs, objs)])
        if not failed:
            failed = _run_all([[cc, *arch, *LDFLAGS, *map(str, objs), "-o", str(out), "-lm"]])
        if not failed:
            return
        errors.extend(failed)
    raise KernelUnavailable("the C compiler failed:\n" + "\n".join(errors))


def build(cache: Path | None = None) -> Path:
    """The path of the kernel library, compiled first where the cache has none for these
    sources, flags, compiler and CPU."""
    cc = _compiler()
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    srcs = sources()
    texts = [f"{p.name}\0{p.read_text()}" for p in sorted(HERE.glob("*.[ch]"))]
    key = hashlib.sha256("\0".join(
        [*texts, " ".join(NATIVE + CFLAGS + LDFLAGS), version, " ".join(sorted(cpu_info().flags))]
    ).encode()).hexdigest()[:16]
    cache = cache if cache is not None else cache_root() / "kernels"
    lib = cache / f"{NAME}-{key}.so"
    if lib.exists():
        return lib
    try:
        # Built in a temporary directory, then renamed into place: processes starting together
        # (tests, data-parallel engines) never load a half-written library.
        work = cache_tmpdir(cache, f".{NAME}-", "kernel")
    except OSError as e:
        raise KernelUnavailable(str(e)) from e
    try:
        tmp = work / f"{NAME}.so"
        _compile(cc, srcs, tmp, work)
        os.replace(tmp, lib)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return lib


@functools.cache
def library() -> ctypes.CDLL:
    """The kernel library, compiled on first use and loaded once per process."""
    path = build()
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        raise KernelUnavailable(f"cannot load {path}: {e}") from e
