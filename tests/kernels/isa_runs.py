"""The kernel tests re-run against the library built for each x86-64 level (issue 28), started in
the background as soon as pytest has collected them (tests/kernels/conftest.py), one level at a
time, so that each level's library build and tests overlap the rest of the suite instead of
adding to it; ``test_isa_levels.py`` waits for its level's result.

Each level runs only the tests whose code differs at that level (no test a level shares with
another build runs twice):

- v2 (no vector layer): the portable decode attention (float32 and bfloat16 caches), the portable
  fused ops and the portable float32 GEMM loop; the child also checks that gemm_f32 says it is
  not built.
- v3 (AVX2 + FMA): every kernel on vec.h's 8-lane layer: the gemm_f32 panels, the fused float32
  decode layer and whole step, the fused ops' vector SiLU, the float32 MoE experts, the grouped
  decode attention, float32 prefill attention, the int8 greedy screen on vpmaddwd, and the
  GGUF block products on 256-bit vectors without VNNI (with their portable activation
  quantizers).
- v4 (AVX-512 without BF16/VNNI): only what differs from this CPU's native build, which the
  ordinary suite runs: the greedy screen on vpmaddwd instead of vpdpwssd and the decode
  attention's bfloat16 caches widened without AVX512-BF16's conversions.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from llmtower.kernels import build
from llmtower.utils import cpu_info

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
CC = os.environ.get("CC") or "cc"
# The levels whose kernel tests run: all three unless LLMTOWER_TEST_ISA_LEVELS names fewer
# (e.g. "v3"; "none" runs none).
LEVELS_ENV = "LLMTOWER_TEST_ISA_LEVELS"
LEVELS = ("v2", "v3", "v4")
# The test that reads these results (its node id's function name).
TEST_NAME = "test_kernel_tests_pass_at_each_x86_level"

GREEDY = [f"test_greedy_head.py::test_{t}" for t in (
    "tokens_are_the_full_layers_argmax", "ties_go_to_the_first_index",
    "rows_the_screen_underrates_still_win", "rows_it_cannot_decide_are_left_to_the_full_layer",
    "grammar_bitmasks_are_applied_as_xgrammar_applies_them")]
# Decode attention with bfloat16 caches (and their float32 twins, a few ms each).
ATTENTION_BF16 = [f"test_paged_attention_kernel.py::test_{t}" for t in (
    "bfloat16_kernel_is_float32_math_rounded_once", "grouped_decode_head_sizes",
    "softmax_over_a_huge_score_range", "output_does_not_depend_on_the_thread_count",
    "bfloat16_grouped_decode_reads_only_the_blocks_in_the_table")] + [
    "test_paged_attention_window.py"]
# Every decode-attention test whose result depends on the compiled code (the build, cache and
# backend-choice tests of that file do not, and run in the ordinary suite only).
ATTENTION = [*ATTENTION_BF16, *(f"test_paged_attention_kernel.py::test_{t}" for t in (
    "kernel_matches_sdpa", "kernel_reads_only_the_blocks_in_the_table",
    "kernel_matches_sdpa_on_random_shapes"))]
FUSED = [f"test_fused_ops.py::test_{t}" for t in (
    "add_rms_norm_is_residual_add_then_transformers_rmsnorm",
    "rope_kv_write_rotates_and_stores_like_the_torch_path",
    "silu_mul_is_silu_of_the_first_half_times_the_second")]
GEMM_F32 = [f"test_gemm_f32.py::test_{t}" for t in (
    "rows_times_matrix_match_float64", "silu_mul_matches_float64",
    "fast_path_sums_as_the_portable_one", "a_row_does_not_depend_on_rows_beside_it_threads_or_stride")]
# The screen's fast path (path 0) only: its portable loops built for v4 are this CPU's native ones.
GREEDY_FAST = [f"test_greedy_head.py::test_tokens_are_the_full_layers_argmax[0-{n}-{k}-dtype{d}]"
               for n, k in ((3000, 576), (777, 75), (64, 32), (130, 2)) for d in (0, 1)] + [
    f"test_greedy_head.py::test_{t}" for t in (
        "ties_go_to_the_first_index", "rows_the_screen_underrates_still_win",
        "rows_it_cannot_decide_are_left_to_the_full_layer")] + [
    f"test_greedy_head.py::test_grammar_bitmasks_are_applied_as_xgrammar_applies_them[0-dtype{d}]"
    for d in (0, 1)]
# The fused float32 decode layer: a whole step (output layer included) at 7 and 64 rows, and
# layers alone at 200 rows on one thread (the panels' row tails), on the odd Qwen2 model.
DECODE_LAYER = [
    f"test_decode_layer.py::test_float32_logits_equal_the_separate_kernels_bit_for_bit[{p}]"
    for p in ("odd_qwen2_dir-7-1-step", "odd_qwen2_dir-64-2-step", "odd_qwen2_dir-200-1-layers")
] + [f"test_decode_layer.py::test_whole_step_samples_any_rows_bit_for_bit[{p}-dtype1]"  # float32
      for p in ("5-rows0-1-False", "4-rows1-2-False", "12-rows2-2-False", "1-rows3-1-False",
                "3-rows4-2-True", "6-rows5-1-True")]
# The GGUF block products' 256-bit code (vpmaddubsw + vpmaddwd without VNNI; Q8_0 by |w| and
# flipped signs) and the portable activation quantizers the AVX-512 build replaces.
QUANT = [f"test_quant_gemm.py::test_product_matches_float_product_of_dequantized[{f}-{m}-0]"
         for f in ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K") for m in (1, 6, 16)] + [
    f"test_quant_gemm.py::test_{t}" for t in (
        "many_row_products_agree_with_portable_code_across_tile_edges", "fast_and_portable_agree",
        "prefill_chunks_over_several_panels_agree_with_portable_code",
        "q8_0_extremes_sum_exactly", "one_row_products_over_eight_block_runs_and_their_tails",
        "k_activations_are_int8_per_256_with_sums_of_16",
        "activations_are_int8_per_32_with_their_sums")] + [
    "test_quant_layer.py::test_logits_equal_the_separate_block_kernels_bit_for_bit"]
LEVEL_TESTS = {
    "v2": [*ATTENTION, *FUSED, "test_gemm_f32.py::test_rows_times_matrix_match_float64"],
    "v3": [*ATTENTION, *FUSED, *GEMM_F32, *GREEDY,
           "test_prefill_attention_f32.py::test_kernel_matches_float64_as_closely_as_sdpa",
           "test_prefill_attention_f32.py::test_threads_do_not_change_results",
           *DECODE_LAYER,
           *(f"test_moe_experts.py::test_kernel_equals_per_expert_path[{p}-dtype0]"  # float32
             for p in ("136-88-4", "201-45-3")),
           *QUANT],
    "v4": [*GREEDY_FAST, *ATTENTION_BF16],
}
# Every test listed runs at its level: none may skip (a kernel a level loses fails its run).
# The child prints the build's level and whether gemm_f32 runs (a vector layer from v3 on), then
# runs its tests: one interpreter and one torch import per level.
CHILD = """import sys, pytest
from llmtower.kernels import ops
c = ops.capabilities()
print("isa-check", c.isa_level, c.can_run("gemm_f32"), flush=True)
sys.exit(pytest.main(["-q", "-x", "-p", "no:cacheprovider", *sys.argv[1:]]))
"""


def runs_here(level: str) -> bool:
    return not (build.X86_LEVELS[level][0] - cpu_info().flags)


def why_skipped(level: str) -> str | None:
    """Why ``level``'s kernel tests do not run here, or None where they do."""
    if level not in os.environ.get(LEVELS_ENV, " ".join(LEVELS)).replace(",", " ").split():
        return f"{LEVELS_ENV} does not name {level} (unset, it runs v2 v3 v4)"
    if not runs_here(level):
        return f"this CPU cannot run x86-64-{level} code"
    if subprocess.run(["sh", "-c", f"command -v {CC}"], capture_output=True).returncode:
        return f"no C compiler {CC!r}"
    return None


@dataclass
class LevelRun:
    """One level's child run: its exit status and output (the last part)."""
    returncode: int
    output: str


class Runner:
    """Owns the background thread that runs the levels' children one after another, and the
    child running now (killed if the session ends first)."""

    def __init__(self, levels: list[str]) -> None:
        self.levels = levels
        self.results: dict[str, LevelRun] = {}
        self.done = {level: threading.Event() for level in levels}
        self._proc: subprocess.Popen[bytes] | None = None
        self._stopped = False
        self._thread = threading.Thread(target=self._run_all, name="isa-levels", daemon=True)
        self._thread.start()

    def _run_all(self) -> None:
        for level in self.levels:
            try:
                self.results[level] = self._run(level)
            except Exception as e:  # reported by the level's test, not lost in a thread
                self.results[level] = LevelRun(-1, f"{type(e).__name__}: {e}")
            self.done[level].set()

    def _run(self, level: str) -> LevelRun:
        if self._stopped:
            return LevelRun(-1, "the session ended first")
        # Passive OpenMP waits: running beside the suite, a thread that spins while its team
        # mate is preempted only burns the core the suite needs (the results do not depend on
        # the thread count: the kernel tests check that).
        env = {**os.environ, build.ISA_ENV: level, "PYTHONPATH": os.pathsep.join(sys.path),
               "OMP_WAIT_POLICY": "PASSIVE"}
        with tempfile.TemporaryFile() as out:
            self._proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, *(str(HERE / t) for t in LEVEL_TESTS[level])],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
            try:
                code = self._proc.wait(timeout=1200)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                code = self._proc.wait()
            out.seek(0)
            return LevelRun(code, out.read().decode(errors="replace")[-6000:])

    def result(self, level: str, timeout: float = 1200) -> LevelRun:
        """``level``'s run, waiting for it (starting nothing: the level must be one of ours)."""
        if not self.done[level].wait(timeout):
            return LevelRun(-1, f"no result for {level} within {timeout} s")
        return self.results[level]

    def stop(self) -> None:
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


_runner: Runner | None = None


def start(levels: list[str]) -> Runner:
    """Starts the background runs of ``levels`` (once per session; later calls return it)."""
    global _runner
    if _runner is None:
        _runner = Runner(levels)
    return _runner


def result(level: str) -> LevelRun:
    """``level``'s run, started now (with that level alone) where collection did not start it."""
    runner = start([level])
    if level not in runner.done:
        return Runner([level]).result(level)
    return runner.result(level)


def stop() -> None:
    if _runner is not None:
        _runner.stop()
