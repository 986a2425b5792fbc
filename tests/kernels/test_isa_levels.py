"""The kernels at every instruction-set level (issue 28): the ``LLMTOWER_CPU_ISA`` setting, the
vector layer (kernels/vec.h) checked for each x86-64 level this CPU runs and for aarch64 NEON
under qemu (with the decode and prefill attention and the GGUF block products built for it), and the kernel tests run against the library built for v2, v3 and v4
(tests/kernels/isa_runs.py: at each level the tests whose code differs there, in the background
from the end of collection), so a path that only AVX2 (or only plain-C) machines take cannot rot
unseen here."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from llmtower.kernels import build
from llmtower.utils import cpu_info
from tests.kernels import isa_runs

HERE = Path(__file__).resolve().parent
KERNELS = build.HERE
CC = os.environ.get("CC") or "cc"
AARCH64_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"


def test_isa_setting_is_read_and_checked(monkeypatch):
    monkeypatch.delenv(build.ISA_ENV, raising=False)
    assert build.isa_level() == "native"
    monkeypatch.setenv(build.ISA_ENV, " V3 ")
    assert build.isa_level() == "v3"
    monkeypatch.setenv(build.ISA_ENV, "avx2")
    with pytest.raises(ValueError, match="v2, v3, v4"):
        build.isa_level()


def test_a_level_this_cpu_cannot_run_is_refused_not_built(monkeypatch):
    monkeypatch.setattr(build, "cpu_info", lambda: type(cpu_info())("an AVX2 CPU",
                                                                    frozenset({"avx2", "fma"})))
    with pytest.raises(build.KernelUnavailable, match="lacks .*avx512f"):
        build._arch_flags("v4")
    assert build._arch_flags("native") == (build.NATIVE, [])


def _check(cmd: list[str], compiler: str, out: Path, *flags: str) -> str:
    subprocess.run([compiler, *flags, "-O2", "-fno-math-errno", f"-I{KERNELS}",
                    str(HERE / "vec_check.c"), "-o", str(out), "-lm"], check=True,
                   capture_output=True, text=True, timeout=120)
    proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.mark.parametrize("level, isa", [("v2", "c"), ("v3", "avx2"), ("v4", "avx512")])
def test_vector_layer_at_each_x86_level(tmp_path, level, isa):
    if "avx2" not in cpu_info().flags or not isa_runs.runs_here(level):
        pytest.skip(f"this CPU cannot run x86-64-{level} code")
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler {CC!r}")
    out = _check([], CC, tmp_path / "vec_check", f"-march=x86-64-{level}")
    assert out.startswith(f"{isa} ") and "failures=0" in out
    assert f" int={int(level != 'v2')} " in out  # the integer layer: vector from AVX2 on


def test_vector_layer_neon_under_qemu_matches_plain_c(tmp_path):
    """The NEON layer and the panel micro-kernel on it, cross-compiled and run under user-mode
    emulation, against plain C (Debian: apt-get install gcc-aarch64-linux-gnu qemu-user)."""
    missing = [t for t in (AARCH64_CC, QEMU) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user)")
    out = _check([QEMU, "-L", "/usr/aarch64-linux-gnu"], AARCH64_CC, tmp_path / "vec_check")
    assert out.startswith("neon lanes=4 fast=1 int=1") and "failures=0" in out


def _attention_check(cmd: list[str], compiler: str, out: Path, *flags: str) -> str:
    """attention_check.c built with the decode-attention sources, run; its output."""
    sources = [HERE / "attention_check.c",
               *(KERNELS / f for f in ("paged_attention.c", "paged_attention_vec.c",
                                       "paged_attention_grouped.c", "lib_init.c"))]
    return _build_and_run(cmd, compiler, sources, out, *flags)


def _build_and_run(cmd: list[str], compiler: str, sources: list[Path], out: Path,
                   *flags: str) -> str:
    """A check program built from ``sources`` with the kernels' flags and run (under ``cmd``);
    its output, after asserting it exited 0."""
    subprocess.run([compiler, *flags, "-O3", "-fopenmp", "-fno-math-errno", f"-I{KERNELS}",
                    *map(str, sources), "-o", str(out), "-lm"], check=True, capture_output=True,
                   text=True, timeout=300)
    proc = subprocess.run([*cmd, str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    return proc.stdout


def test_decode_attention_neon_under_qemu_matches_float64(tmp_path):
    """paged decode attention built for aarch64 (its NEON grouped path, paged_attention_vec.c)
    under user-mode emulation, against a float64 reference: float32 and bfloat16, sliding
    windows, scattered blocks, the head sizes it takes and one it leaves to the portable loop."""
    missing = [t for t in (AARCH64_CC, QEMU) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user)")
    out = _attention_check([QEMU, "-L", "/usr/aarch64-linux-gnu"], AARCH64_CC,
                           tmp_path / "attention_check")
    assert out.strip().endswith("failures=0")


@pytest.mark.parametrize("arch", ["armv8.2-a+dotprod", "armv8-a"])
def test_gguf_block_products_neon_under_qemu_match_float64(tmp_path, arch):
    """The GGUF block products built for aarch64 (quant_gemm.c, quant_gemm_k.c: their NEON
    bodies, with ARMv8.2's sdot and with baseline ARMv8's widening multiplies) under user-mode
    emulation: every format's fast and portable products against a float64 reference over row
    counts, block tails and threads, the activations' int8 forms exactly, and Q8_0's extremes
    (tests/kernels/quant_check.c)."""
    missing = [t for t in (AARCH64_CC, QEMU) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user)")
    sources = [HERE / "quant_check.c",
               *(KERNELS / f for f in ("quant_gemm.c", "quant_gemm_k.c", "quant_gemm_16.c",
                                       "quant_gemm_k16.c"))]
    out = _build_and_run([QEMU, "-L", "/usr/aarch64-linux-gnu"], AARCH64_CC, sources,
                         tmp_path / "quant_check", f"-march={arch}")
    assert out.strip().splitlines()[-1] == "fast=1 failures=0", out[-3000:]


def test_prefill_attention_neon_under_qemu_matches_float64(tmp_path):
    """float32 prefill attention built for aarch64 (its NEON score and value passes, sized to
    32 registers) under user-mode emulation, against a float64 causal softmax: chunk lengths
    around its 16-row blocks, grouped heads, strided rows, 1 and 2 threads
    (tests/kernels/prefill_check.c)."""
    missing = [t for t in (AARCH64_CC, QEMU) if shutil.which(t) is None]
    if missing:
        pytest.skip(f"{' and '.join(missing)} not installed (Debian: apt-get install "
                    "gcc-aarch64-linux-gnu qemu-user)")
    sources = [HERE / "prefill_check.c", KERNELS / "prefill_attention_f32.c",
               KERNELS / "lib_init.c"]
    out = _build_and_run([QEMU, "-L", "/usr/aarch64-linux-gnu"], AARCH64_CC, sources,
                         tmp_path / "prefill_check")
    assert out.strip().splitlines()[-1] == "built=1 failures=0", out[-3000:]


@pytest.mark.parametrize("level", ["v2", "v3"])
def test_decode_attention_at_x86_levels_matches_float64(tmp_path, level):
    """The same check built for x86-64-v2 (the portable loop) and v3 (the AVX2 grouped path)."""
    if "avx2" not in cpu_info().flags or not isa_runs.runs_here(level):
        pytest.skip(f"this CPU cannot run x86-64-{level} code")
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler {CC!r}")
    out = _attention_check([], CC, tmp_path / "attention_check", f"-march=x86-64-{level}")
    assert out.strip().endswith("failures=0")


@pytest.mark.parametrize("level", isa_runs.LEVELS)
def test_kernel_tests_pass_at_each_x86_level(level):
    """The kernel tests of ``isa_runs.LEVEL_TESTS[level]`` (those whose code differs at that
    level) in a child process whose library is built for ``level`` (its own cache entry): at v2
    the portable code, at v3 the AVX2 layer, at v4 AVX-512 without BF16/VNNI. The child runs in
    the background from the end of collection (tests/kernels/conftest.py); this waits for it."""
    why = isa_runs.why_skipped(level)
    if why is not None:
        pytest.skip(why)
    run = isa_runs.result(level)
    assert run.returncode == 0, run.output
    summary = run.output.strip().splitlines()[-1]
    assert " passed" in summary and "skipped" not in summary, run.output  # a kernel gone
    check = next((line.split() for line in run.output.splitlines()
                  if line.startswith("isa-check ")), [])
    assert check == ["isa-check", level, str(level != "v2")], run.output
