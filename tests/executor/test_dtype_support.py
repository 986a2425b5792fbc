"""Every dtype on an AVX2-only CPU, emulated (oneDNN and ATen capped at AVX2, the C kernels
built for x86-64-v3): float32 with each KV-cache dtype and int8/int4 weights generates, and
bfloat16, which oneDNN cannot compute there, is refused when the engine starts with a message
that says to use float32, instead of dying inside generate() (issue 28). One subprocess runs
every case (the emulation must be set before torch starts)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from llmtower.utils import cpu_info

# Each case: dtype, quantization, KV-cache dtype, LLMTOWER_ALLOW_SLOW_BF16; the child prints
# one JSON line per case.
CHILD = r"""
import json, os, sys
from llmtower import LLM, SamplingParams
cases = json.loads(sys.argv[2])
for dtype, quant, kv, allow in cases:
    os.environ["LLMTOWER_ALLOW_SLOW_BF16"] = allow
    try:
        llm = LLM(model=sys.argv[1], dtype=dtype, quantization=quant, kv_cache_dtype=kv,
                  num_threads=1, kv_cache_memory="8MiB", max_model_len=64)
        out = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=3,
                           ignore_eos=True), use_tqdm=False)
        print(json.dumps({"case": [dtype, quant, kv, allow], "tokens": out[0].outputs[0].token_ids}))
    except ValueError as e:
        print(json.dumps({"case": [dtype, quant, kv, allow], "refused": str(e)}))
    sys.stdout.flush()
"""
AVX2 = {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "LLMTOWER_CPU_ISA": "v3"}


def run_emulated(model: Path, cases: list[tuple[str, str, str, str]]) -> list[dict]:
    full = {**os.environ, **AVX2, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(model), json.dumps(cases)],
                          env=full, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


CASES = [("float32", "none", "auto", "0"), ("float32", "none", "bfloat16", "0"),
         ("float32", "none", "int8", "0"), ("float32", "int8", "auto", "0"),
         ("float32", "int4", "int8", "0"), ("bfloat16", "none", "auto", "0"),
         ("bfloat16", "int8", "bfloat16", "0"),
         ("bfloat16", "none", "auto", "1"), ("bfloat16", "int4", "int8", "1")]


@pytest.fixture(scope="module")
def emulated(tiny_llama_dir) -> dict[tuple[str, ...], dict]:
    if "avx2" not in cpu_info().flags:
        pytest.skip("needs an x86-64 CPU with AVX2 (the emulation caps an x86 CPU at AVX2)")
    results = run_emulated(tiny_llama_dir, CASES)
    assert [r["case"] for r in results] == [list(c) for c in CASES]
    return {tuple(r["case"]): r for r in results}


def test_float32_runs_every_kv_dtype_and_quantization_on_avx2(emulated):
    for case in CASES:
        if case[0] == "float32":
            assert len(emulated[case]["tokens"]) == 3, emulated[case]


def test_bfloat16_is_refused_at_start_on_avx2_saying_what_to_use(emulated):
    """oneDNN has no bfloat16 inner product below AVX-512: refused by LLM(...), not mid-request."""
    for case in CASES:
        if case[0] == "bfloat16" and case[3] == "0":
            assert "tokens" not in emulated[case]
            assert "--dtype float32" in emulated[case]["refused"], emulated[case]


def test_bfloat16_forced_on_avx2_runs_without_a_crash(emulated):
    """LLMTOWER_ALLOW_SLOW_BF16=1 runs bfloat16 on PyTorch's own GEMM (slow) instead of oneDNN's
    missing one: tokens, no exception."""
    for case in CASES:
        if case[3] == "1":
            assert len(emulated[case]["tokens"]) == 3, emulated[case]
