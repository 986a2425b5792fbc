"""What this CPU and this build of the kernel library can run: one ``Capabilities`` object,
the only place callers ask whether a fast path exists (and why not, for the start log).

``capabilities()`` builds the library on first call (``build.library``), asks it what it was
compiled for and which kernels have their fast code, and checks its vector exp against libm once;
the answer is cached for the process. A kernel missing from ``Capabilities.unavailable`` can run;
each one present carries the reason it cannot (no compiler, a CPU without AVX512_BF16, turned off
by an environment variable), which callers log when they fall back to PyTorch. Tests and
benchmarks that want a path off replace the object (``without``), never a kernel module.

The kernels, by name:

    fused_ops          add + RMSNorm, RoPE + KV write, silu * up (fused_ops.c)
    paged_attention    decode attention over the paged KV cache (paged_attention*.c)
    prefill_bf16       bfloat16 causal prefill attention (prefill_attention.c; AVX512_BF16)
    prefill_f32        float32 causal prefill attention (prefill_attention_f32.c; vec.h)
    gemv_bf16          bfloat16 few-row products (gemv_bf16.c; AVX512_BF16)
    gemm_bf16          bfloat16 decode-step products (gemm_bf16.c; AVX512_BF16)
    gemm_f32           float32 decode-step products (gemm_f32.c; vec.h: AVX-512, AVX2+FMA, NEON)
    decode_layer_bf16  the fused bfloat16 decode layer (decode_layer.c; AVX512_BF16)
    decode_layer_f32   the fused float32 decode layer (decode_layer.c; as gemm_f32)
    moe_experts_bf16   a decode step's chosen experts in one call, bfloat16 (moe_experts.c; as gemv_bf16)
    moe_experts_f32    the same, float32 (moe_experts.c; as gemm_f32)
    greedy_head        the greedy output layer's int8 screen (greedy_head.c; vec.h's integer layer)
    quant_gemm         products by GGUF block-quantized weights (quant_gemm.c, quant_gemm_k.c,
                       and quant_layer.c's fused decode layer over them; AVX2+FMA+F16C, AVX512_VNNI)
    cpu_bind           pinning the OpenMP threads (cpu_bind.c)
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from llmtower.kernels.build import ISA_ENV, KernelUnavailable, isa_level, library
from llmtower.utils import cpu_info

logger = logging.getLogger(__name__)
# The instruction sets a capability report names (lib_init.c's kernel_isa lists those the
# build targets).
ISA_FLAGS = ("avx512f", "avx512bw", "avx512_bf16", "avx512_vnni", "avx2", "fma", "f16c",
             "avx_vnni", "asimd")
KERNELS = ("fused_ops", "paged_attention", "prefill_bf16", "prefill_f32", "gemv_bf16",
           "gemm_bf16", "gemm_f32", "decode_layer_bf16", "decode_layer_f32", "moe_experts_bf16",
           "moe_experts_f32", "greedy_head", "quant_gemm", "cpu_bind")
# The kernels that come in one variant per dtype: family -> {dtype: kernel}.
BY_DTYPE = {
    "decode_layer": {torch.float32: "decode_layer_f32", torch.bfloat16: "decode_layer_bf16"},
    "prefill": {torch.float32: "prefill_f32", torch.bfloat16: "prefill_bf16"},
    "moe_experts": {torch.float32: "moe_experts_f32", torch.bfloat16: "moe_experts_bf16"},
}

# The per-call attention options (``PagedAttention.forward``'s keywords) each attention kernel
# takes; a call asking for one its kernel lacks runs on the torch path instead.
ATTENTION_OPTIONS: dict[str, frozenset[str]] = {
    "paged_attention": frozenset({"sliding_window"}),  # float32 / bfloat16 caches
    "paged_attention_int8": frozenset({"sliding_window"}),  # --kv-cache-dtype int8 / bfloat16
    "prefill_bf16": frozenset(),
    "prefill_f32": frozenset(),
}


def kernel_takes(kernel: str, options: frozenset[str]) -> bool:
    """Whether attention kernel ``kernel`` computes a call with these options itself."""
    return options <= ATTENTION_OPTIONS[kernel]


_NO_BF16 = "this CPU (or compiler) has no AVX512_BF16"
_NO_VEC = ("the kernels were built without a vector layer (vec.h: AVX-512, AVX2 with FMA, or "
           "NEON; LLMTOWER_CPU_ISA=v2 builds none)")
_SDPA = "prefill keeps PyTorch's SDPA"
# kernel -> (the library's function that says whether its fast code was compiled in, that
# function's arguments, why the kernel is off where it says no). The others (fused_ops,
# paged_attention, cpu_bind) have portable code and run wherever the library builds.
_FAST_CODE: dict[str, tuple[str, tuple[int, ...], str]] = {
    "prefill_bf16": ("prefill_supported", (), f"{_NO_BF16}: {_SDPA}"),
    "prefill_f32": ("prefill_f32_supported", (), f"{_NO_VEC}: {_SDPA}"),
    "gemv_bf16": ("gemv_bf16_fast", (), f"{_NO_BF16}: bfloat16 decode GEMMs stay on oneDNN"),
    "gemm_bf16": ("gemm_bf16_fast", (), f"{_NO_BF16}: bfloat16 decode GEMMs stay on oneDNN"),
    "gemm_f32": ("gemm_f32_fast", (), f"{_NO_VEC}: float32 GEMMs stay on oneDNN"),
    "decode_layer_bf16": ("decode_layer_fast", (1,), _NO_BF16),
    "decode_layer_f32": ("decode_layer_fast", (0,), _NO_VEC),
    "moe_experts_bf16": ("moe_experts_fast", (1,), f"{_NO_BF16}: experts run one by one"),
    "moe_experts_f32": ("moe_experts_fast", (0,), f"{_NO_VEC}: experts run one by one"),
    "greedy_head": ("greedy_head_fast", (), _NO_VEC),
    # The portable code runs anywhere but slower than a float GEMM: GGUF block weights are
    # dequantized to the model's dtype where the fast code is missing.
    "quant_gemm": ("quant_gemm_fast", (), "the kernels are built without AVX2, FMA and F16C "
                   "(x86-64-v3) or NEON: GGUF block weights are dequantized to the model's dtype"),
}


@dataclass(frozen=True)
class Capabilities:
    """Owns the answer to "can this kernel run here?" for every kernel of the library: the
    library's path (None where it could not be built), the ISA flags this CPU lists and those
    the build targets, the level it was built for (``LLMTOWER_CPU_ISA``), whether the vector exp
    is libm's expf to the bit, and for each kernel that cannot run, why."""

    library: str | None
    cpu_isa: frozenset[str]
    build_isa: frozenset[str]
    vector_exp: bool
    unavailable: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))
    isa_level: str = "native"

    def can_run(self, kernel: str) -> bool:
        """Whether ``kernel`` (one of ``KERNELS``) has its fast path here."""
        return self.why_not(kernel) is None

    def why_not(self, kernel: str) -> str | None:
        """Why ``kernel`` cannot run here, or None when it can."""
        if kernel not in KERNELS:
            raise KeyError(f"no kernel {kernel!r}; the kernels are {', '.join(KERNELS)}")
        return self.unavailable.get(kernel)

    def why_not_in(self, family: str, dtype: torch.dtype) -> str | None:
        """Why ``family``'s kernel for ``dtype`` (``BY_DTYPE``) cannot run here (including: it
        has none for that dtype), or None when it can."""
        kernel = BY_DTYPE[family].get(dtype)
        if kernel is None:
            names = " and ".join(str(d).removeprefix("torch.") for d in BY_DTYPE[family])
            return f"the {family} kernel runs {names}, not {dtype}"
        return self.why_not(kernel)

    def without(self, kernel: str, reason: str) -> Capabilities:
        """A copy in which ``kernel`` cannot run, for ``reason`` (tests and benchmarks)."""
        self.why_not(kernel)  # a known name
        return dataclasses.replace(
            self, unavailable=MappingProxyType({**self.unavailable, kernel: reason}))

    def describe(self) -> list[str]:
        """One line per kernel (``name: on`` or ``name: off (why)``), then the ISA lines: what
        a diagnostics report prints."""
        lines = [f"{k}: on" if self.can_run(k) else f"{k}: off ({self.why_not(k)})"
                 for k in KERNELS]
        lines.append(f"library: {self.library or 'not built'}")
        lines.append(f"isa level: {self.isa_level} ({ISA_ENV})")
        lines.append("cpu isa: " + (" ".join(f for f in ISA_FLAGS if f in self.cpu_isa) or "-"))
        lines.append("build isa: " + (" ".join(f for f in ISA_FLAGS if f in self.build_isa)
                                      or "-"))
        lines.append(f"vector exp is libm's expf: {self.vector_exp}")
        return lines


def _fast(lib: ctypes.CDLL, fn: str, *args: int) -> bool:
    f = getattr(lib, fn)
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_int] * len(args)
    return bool(f(*args))


def probe() -> Capabilities:
    """Builds and asks the library (uncached: ``capabilities`` caches it)."""
    cpu_isa = frozenset(f for f in ISA_FLAGS if f in cpu_info().flags)
    level = isa_level()
    try:
        lib = library()
    except KernelUnavailable as e:
        return Capabilities(None, cpu_isa, frozenset(), False,
                            MappingProxyType({k: str(e) for k in KERNELS}), level)
    lib.kernel_isa.restype = ctypes.c_char_p
    build_isa = frozenset(lib.kernel_isa().decode().split())
    off = {k: why for k, (fn, args, why) in _FAST_CODE.items() if not _fast(lib, fn, *args)}
    if os.environ.get("LLMTOWER_GREEDY_HEAD", "1") == "0":
        off["greedy_head"] = "LLMTOWER_GREEDY_HEAD=0"
    return Capabilities(str(lib._name), cpu_isa, build_isa,
                        _fast(lib, "kernel_vector_exp_check"), MappingProxyType(off), level)


@functools.cache
def capabilities() -> Capabilities:
    """This process's ``Capabilities`` (the kernel library built and probed on first call; the
    kernels that cannot run are logged then, once, with their reasons)."""
    caps = probe()
    logger.info("C kernels built for %s=%s (%s)", ISA_ENV, caps.isa_level,
                " ".join(f for f in ISA_FLAGS if f in caps.build_isa) or "no vector extensions")
    for kernel, why in caps.unavailable.items():
        logger.info("C kernel %s off: %s", kernel, why)
    return caps


def kernel_library() -> ctypes.CDLL:
    """The loaded kernel library, after ``capabilities()`` has probed it (so the vector exp's
    check has run): what the kernels' Python sides call into. Raises ``KernelUnavailable``
    where it could not be built."""
    capabilities()
    return library()
