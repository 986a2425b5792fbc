"""The kernels at every instruction-set level (issue 28): the ``LLMTOWER_CPU_ISA`` setting, the
vector layer (kernels/vec.h) checked for each x86-64 level this CPU runs and for aarch64 NEON
under qemu, and the kernel tests run against the library built for v2, v3 and v4, so a path that
only AVX2 (or only plain-C) machines take cannot rot unseen here."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmtower.kernels import build
from llmtower.utils import cpu_info

HERE = Path(__file__).resolve().parent
KERNELS = build.HERE
CC = os.environ.get("CC") or "cc"
AARCH64_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
# The kernel tests re-run at each level: those whose fast paths the vector layer now carries
# (v3: the float32 panels, decode attention's vector path, float32 prefill attention, the int8
# greedy screen on AVX2's vpmaddwd) and the portable attention and fused ops every level runs.
# v4's attention is the AVX-512 path the ordinary suite already runs on this CPU; its screen
# takes vpmaddwd instead of VNNI's vpdpwssd.
# the screen's own tests (its engine tests re-run the model, not the kernel)
GREEDY_KERNEL_TESTS = [f"test_greedy_head.py::test_{t}" for t in (
    "tokens_are_the_full_layers_argmax", "ties_go_to_the_first_index",
    "rows_the_screen_underrates_still_win", "rows_it_cannot_decide_are_left_to_the_full_layer",
    "grammar_bitmasks_are_applied_as_xgrammar_applies_them")]
LEVEL_TESTS = {"v2": ["test_gemm_f32.py", "test_fused_ops.py", "test_paged_attention_kernel.py"],
               "v3": ["test_gemm_f32.py", "test_fused_ops.py", "test_paged_attention_kernel.py",
                      "test_paged_attention_window.py", "test_prefill_attention_f32.py",
                      *GREEDY_KERNEL_TESTS],
               "v4": ["test_gemm_f32.py", "test_fused_ops.py", *GREEDY_KERNEL_TESTS]}


def _runs_here(level: str) -> bool:
    return not (build.X86_LEVELS[level][0] - cpu_info().flags)


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
    if "avx2" not in cpu_info().flags or not _runs_here(level):
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
    subprocess.run([compiler, *flags, "-O2", "-fopenmp", "-fno-math-errno", f"-I{KERNELS}",
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


@pytest.mark.parametrize("level", ["v2", "v3"])
def test_decode_attention_at_x86_levels_matches_float64(tmp_path, level):
    """The same check built for x86-64-v2 (the portable loop) and v3 (the AVX2 grouped path)."""
    if "avx2" not in cpu_info().flags or not _runs_here(level):
        pytest.skip(f"this CPU cannot run x86-64-{level} code")
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler {CC!r}")
    out = _attention_check([], CC, tmp_path / "attention_check", f"-march=x86-64-{level}")
    assert out.strip().endswith("failures=0")


# The levels whose kernel tests run (a library build and ~30 s of tests each on a quiet 2-core
# machine): v3, the AVX2 path no CI machine of ours takes otherwise, unless
# LLMTOWER_TEST_ISA_LEVELS names others ("v2 v3 v4": every level, as a separate CI step).
LEVELS_ENV = "LLMTOWER_TEST_ISA_LEVELS"


@pytest.mark.parametrize("level", ["v2", "v3", "v4"])
def test_kernel_tests_pass_at_each_x86_level(level):
    """The kernel tests of LEVEL_TESTS in a child process whose library is built for ``level``
    (its own cache entry): at v2 the portable code, at v3 the AVX2 layer, at v4 AVX-512 without
    BF16/VNNI."""
    if level not in os.environ.get(LEVELS_ENV, "v3").replace(",", " ").split():
        pytest.skip(f"{LEVELS_ENV} does not name {level} (set it to 'v2 v3 v4' to run every level)")
    if not _runs_here(level):
        pytest.skip(f"this CPU cannot run x86-64-{level} code")
    if shutil.which(CC) is None:
        pytest.skip(f"no C compiler {CC!r}")
    env = {**os.environ, build.ISA_ENV: level, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           *(str(HERE / t) for t in LEVEL_TESTS[level])],
                          env=env, capture_output=True, text=True, timeout=1200,
                          cwd=HERE.parent.parent)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    child = subprocess.run([sys.executable, "-c", "from llmtower.kernels import ops; "
                            "c = ops.capabilities(); print(c.isa_level, c.can_run('gemm_f32'))"],
                           env=env, capture_output=True, text=True, timeout=600)
    assert child.stdout.split() == [level, str(level != "v2")], child.stdout + child.stderr
