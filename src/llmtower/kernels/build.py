"""Compiles llmtower's C kernels into one shared library on first use and caches it.

The kernels are plain C files next to this one (no PyTorch headers). Every ``*.c`` here is
compiled to an object with the system C compiler (``$CC``, else ``cc``) for the instruction-set
level ``LLMTOWER_CPU_ISA`` names (``isa_level``: ``native``, the default, is this very CPU;
``v2``/``v3``/``v4`` are the x86-64 levels, so an AVX2-only or AVX-512 machine's build can be
made and tested on any machine that runs it), in parallel, and the objects are linked into ONE
shared library, ``$XDG_CACHE_HOME/llmtower/kernels/llmtower_kernels-<key>.so``, where the key
hashes every source and header here, the flags (the level's among them), the compiler and the
CPU's feature flags; it is then loaded once with ``ctypes``. One library means one copy of the state the headers share (the few-row tiles'
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
ISA_ENV = "LLMTOWER_CPU_ISA"
# x86-64 level -> (the CPU flags it needs, by /proc/cpuinfo's names; the compiler flags: the
# level's -march, else the same features one by one for compilers that do not know the level).
X86_LEVELS: dict[str, tuple[frozenset[str], tuple[list[str], ...]]] = {
    "v2": (frozenset({"ssse3", "sse4_1", "sse4_2", "popcnt", "cx16"}),
           (["-march=x86-64-v2"], ["-march=x86-64", "-mssse3", "-msse4.2", "-mpopcnt"])),
    "v3": (frozenset({"ssse3", "sse4_2", "popcnt", "avx", "avx2", "fma", "f16c", "bmi1", "bmi2",
                      "movbe", "abm"}),
           (["-march=x86-64-v3"], ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mbmi",
                                   "-mbmi2", "-mlzcnt", "-mmovbe"])),
    "v4": (frozenset({"avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512cd",
                      "avx512dq", "avx512vl"}),
           (["-march=x86-64-v4"], ["-march=x86-64", "-mavx2", "-mfma", "-mf16c", "-mbmi",
                                   "-mbmi2", "-mlzcnt", "-mmovbe", "-mavx512f", "-mavx512bw",
                                   "-mavx512cd", "-mavx512dq", "-mavx512vl"])),
}
ISA_LEVELS = ("native", *X86_LEVELS)


class KernelUnavailable(RuntimeError):
    """A kernel could not be built or loaded here (no C compiler, or it failed)."""


def isa_level() -> str:
    """The instruction-set level the kernels are built for: ``$LLMTOWER_CPU_ISA`` (one of
    ``ISA_LEVELS``), ``native`` when unset. Raises ValueError, saying what to set, for any
    other value."""
    level = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"{ISA_ENV}={level!r} is not a level; set it to one of "
                         f"{', '.join(ISA_LEVELS)} (or unset it: native)")
    return level


def _arch_flags(level: str) -> tuple[list[str], ...]:
    """The -march spellings to try for ``level``, in order (the last one plain: a compiler that
    knows none of them still builds the portable code). Raises KernelUnavailable where this CPU
    cannot run code of that level (the library would die of an illegal instruction)."""
    if level == "native":
        return (NATIVE, [])
    needs, flags = X86_LEVELS[level]
    missing = sorted(needs - cpu_info().flags)
    if missing:
        raise KernelUnavailable(f"{ISA_ENV}={level}: this CPU lacks {' '.join(missing)}; "
                                f"set a lower level or native")
    return flags


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


def _compile(cc: str, arches: tuple[list[str], ...], srcs: list[Path], out: Path,
             work: Path) -> None:
    errors: list[str] = []
    for arch in arches:  # -march=native / x86-64-v3 is not known to every compiler
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
    sources, flags (``isa_level``'s among them), compiler and CPU."""
    cc = _compiler()
    arches = _arch_flags(isa_level())
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KernelUnavailable(f"{cc} --version failed: {e}") from e
    srcs = sources()
    texts = [f"{p.name}\0{p.read_text()}" for p in sorted(HERE.glob("*.[ch]"))]
    # The compiler's own path too: a CC wrapper (one that rewrites -march=native to emulate an
    # older CPU) prints the same --version as the compiler it runs, but builds another library.
    where = os.path.realpath(shutil.which(cc) or cc)
    key = hashlib.sha256("\0".join(
        [*texts, " ".join(arches[0] + CFLAGS + LDFLAGS), where, version,
         " ".join(sorted(cpu_info().flags))]
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
        _compile(cc, arches, srcs, tmp, work)
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
