"""Whether the model's dtype can run at a usable speed on this CPU, decided at start-up: a dtype
that cannot is refused there with what to use instead, never discovered mid-request.

bfloat16 needs a bfloat16 matrix product: oneDNN has one on CPUs with AVX-512 (AVX512_BF16 and
AMX natively, plain AVX-512 by conversion) and none on AVX2-only ones (Intel desktop and laptop
parts, AMD before Zen 4), where its inner product raises "could not create a primitive
descriptor". PyTorch's own bfloat16 GEMM is correct there, but measured on SmolLM2's matrices
(AVX2 emulated, one thread, CPU time) it takes 4.3-6.1x float32's time at 64 rows (0.6-0.8x at
one row: half the bytes to read), so batches and prefills would run several times slower than
in float32 (docs/performance.md, "AVX2 and other ISA levels"); the engine refuses bfloat16 on
such a CPU at start rather than serving the default workload at a fraction of float32's speed.
float32 runs everywhere; the KV-cache dtypes (bfloat16, int8) and int8/int4 weights run on any
x86-64 level (tests/executor/test_dtype_support.py runs them under an emulated AVX2 CPU).
"""
from __future__ import annotations

import torch

from llmtower.models import linear

# Set to 1 to run bfloat16 on a CPU without a fast bfloat16 product anyway (slow; for tests).
ALLOW_ENV = "LLMTOWER_ALLOW_SLOW_BF16"


def dtype_refusal(dtype: torch.dtype, allow_slow: bool = False) -> str | None:
    """Why the engine refuses to run a model in ``dtype`` on this CPU (a message saying what to
    use instead), or None where it runs."""
    if dtype != torch.bfloat16 or linear.BF16_FAST or allow_slow:
        return None
    return ("--dtype bfloat16 is refused on this CPU: it has no fast bfloat16 matrix product "
            "(oneDNN's needs AVX-512; this CPU, or ONEDNN_MAX_CPU_ISA, stops below it) and "
            "PyTorch's fallback takes 4-6x float32's time on batches. Use --dtype float32 "
            "(the same weights, computed in float32; --kv-cache-dtype bfloat16 or int8 still halves or "
            f"quarters the KV cache), or set {ALLOW_ENV}=1 to run bfloat16 slowly anyway.")
