"""utils: what --dtype auto picks on a CPU, from its /proc/cpuinfo flags."""
from __future__ import annotations

import pytest

from llmtower.engine.args import EngineArgs
from llmtower.utils import AUTO_DTYPE_ENV, CpuInfo, auto_dtype


@pytest.mark.parametrize("flags, dtype, named", [
    ({"avx512f", "avx512_bf16", "amx_bf16"}, "bfloat16", "avx512_bf16, amx_bf16"),
    ({"avx512f", "amx_bf16"}, "bfloat16", "amx_bf16"),
    ({"fp", "asimd", "bf16"}, "bfloat16", "bf16"),  # Arm's Features line
    ({"avx512f", "avx2", "fma"}, "float32", "no native bfloat16"),
    (set(), "float32", "no native bfloat16"),
])
def test_auto_dtype_follows_native_bfloat16(monkeypatch, flags, dtype, named):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    got, why = auto_dtype(CpuInfo("cpu", frozenset(flags)))
    assert got == dtype and named in why


@pytest.mark.parametrize("cap, dtype", [("AVX2", "float32"), ("avx512_core", "float32"),
                                        ("AVX512_CORE_BF16", "bfloat16"),
                                        ("AVX512_CORE_AMX", "bfloat16"), ("", "bfloat16")])
def test_auto_dtype_follows_a_onednn_cap_below_bfloat16(monkeypatch, cap, dtype):
    """An AVX2-only CPU emulated on a bfloat16 one (ONEDNN_MAX_CPU_ISA=AVX2) gets float32
    from --dtype auto, as the real one would, not a bfloat16 the engine then refuses."""
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)
    monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)
    got, why = auto_dtype(CpuInfo("cpu", frozenset({"avx512f", "avx512_bf16"})))
    assert got == dtype
    assert ("ONEDNN_MAX_CPU_ISA" in why) == (dtype == "float32")


def test_auto_dtype_is_the_default_and_the_environment_can_decide_it(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    args = EngineArgs()
    assert args.dtype == "auto" and args.resolved_dtype() == "bfloat16"
    assert EngineArgs(dtype="float32").resolved_dtype() == "float32"
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float16")
    with pytest.raises(ValueError, match="LLMTOWER_AUTO_DTYPE='float16' is invalid"):
        EngineArgs()
