"""The model's matrix products on CPU: oneDNN where this torch has it, plain torch otherwise.

oneDNN's matmul (the op ``torch.compile`` emits for CPU linears) runs W1's decode shapes (64
rows, weights not in cache) at ~160 GFLOPS where ``F.linear``'s MKL path gets ~110, and is no
slower on large batches. It can also apply SiLU to its output and multiply by another tensor
inside the GEMM, which saves the MLP two passes over its largest activation. Both paths compute
in full float32 (or bfloat16 with float32 accumulation); they differ only in summation order.

Weights are handed to oneDNN pre-packed (``prepack``): its matmul computes on a blocked weight
layout, and a plain row-major weight is reordered into it on every call. Packed once at load,
SmolLM2's bfloat16 GEMMs took (one thread) 1.7-2x less time at one row (the reorder is most of
a GEMV), 10-20% less at 64 rows, 3-6% less at 2048; float32 1.1-1.2x at 64 rows. Packing
changes the layout only: from two rows up the results are bit for bit those of the plain
weight. At one row the plain float32 weight takes a GEMV with another summation order; the
packed one computes that row as it would inside any batch (a row's result does not depend on
how many rows run beside it).

bfloat16 matrices also keep a copy for our few-row kernel (``PackedWeight``, where the CPU has
AVX512_BF16): decode steps of up to ``GEMV_MAX_ROWS`` rows read that one at the memory's read
rate; it sums in oneDNN's order, and its results differ from oneDNN's in ~1 value in 40,000 by
the last bfloat16 bit.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from llmtower.kernels import ops
from llmtower.kernels.gemm_bf16 import gemm_bf16, gemm_bf16_silu_mul
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.utils import cpu_info

Linear = Callable[..., torch.Tensor]


class PackedWeight:
    """Owns one weight matrix in the two layouts its products read: oneDNN's packed one (any
    row count) and a decode-step kernel's: bfloat16 ``kernels/gemv_bf16.py`` (few rows),
    float32 ``kernels/gemm_f32.py`` (``f32``: up to ``F32_KERNEL_MAX_ROWS`` rows).
    For the MLP's gate, ``gemv`` holds gate and up together (``silu_mul`` reads both at once)."""

    __slots__ = ("onednn", "gemv", "f32")

    def __init__(self, onednn: torch.Tensor, gemv: GemvWeight | GemmF32Weight) -> None:
        self.onednn = onednn
        self.gemv = gemv
        self.f32 = isinstance(gemv, GemmF32Weight)

    @property
    def shape(self) -> torch.Size:
        return self.onednn.shape


# Products of at most this many rows by a PackedWeight take the few-row kernel. It reads each
# matrix once for up to 4 rows (8: twice, from cache); over SmolLM2's matrices (AVX512_BF16, 2
# threads) it was 1.05-1.15x faster than oneDNN's bfloat16 GEMM at one row and ~1.3x at 2-8 in
# isolation, and a whole decode step 1.16-1.30x (docs/performance.md). 0 turns the kernel off
# (benchmarks/gemv_bf16.py compares the two in one process).
GEMV_MAX_ROWS = 8
# Products of at most this many rows by a float32 PackedWeight take kernels/gemm_f32.c. Decode
# steps (weights from memory): SmolLM2's matrices 1.3-1.45x oneDNN at 64 rows, 1.1-1.25x at
# 128, ~1.05x at 256; from ~512 rows (prefill chunks, weights in cache) oneDNN is level or ahead
# (docs/performance.md). 0 turns the kernel off.
F32_KERNEL_MAX_ROWS = 256
# Products of more than GEMV_MAX_ROWS and at most this many rows by a bfloat16 PackedWeight take
# kernels/gemm_bf16.c, which reads the few-row kernel's copy (no third one) and sums as it does:
# a row's result is the same at any row count up to here. 0 turns the kernel off
# (benchmarks/gemm_bf16.py compares the two in one process).
BF16_KERNEL_MAX_ROWS_AVX512 = 256


def bf16_kernel_max_rows(flags: frozenset[str]) -> int:
    """``BF16_KERNEL_MAX_ROWS`` for a CPU with these /proc/cpuinfo flags. With AVX512-BF16
    alone, gemm_bf16 beats oneDNN up to 256 rows (AMD Zen 4: 1.2-1.5x). Where the CPU has AMX
    tiles, oneDNN multiplies bfloat16 on them: SmolLM2's decode matrices (Xeon, 2 threads,
    ``benchmarks/gemm_bf16.py --shapes-only``) ran 1.3x faster on oneDNN at 16 rows, 3-4x at
    64 and more, and level at 8-12, so there the few-row kernel's 8 rows are the kernels' share
    and everything above goes to oneDNN."""
    return 0 if "amx_bf16" in flags else BF16_KERNEL_MAX_ROWS_AVX512


BF16_KERNEL_MAX_ROWS = bf16_kernel_max_rows(cpu_info().flags)


def decode_kernel_rows(weight: PackedWeight) -> int:
    """Most rows for which ``linear(x, weight)`` sums as the weight's decode-step kernel does
    (the few-row kernel, or gemm_bf16 with its sums; gemm_f32): a row's result there does not
    depend on how many rows run beside it."""
    if weight.f32:
        return F32_KERNEL_MAX_ROWS
    if ops.capabilities().can_run("gemm_bf16"):
        return max(GEMV_MAX_ROWS, BF16_KERNEL_MAX_ROWS)
    return GEMV_MAX_ROWS


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return F.linear(x, weight, bias)


def _plain_silu_mul(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(F.linear(x, gate)).mul_(F.linear(x, up))


def _onednn_ops() -> tuple[Linear, Callable[..., torch.Tensor], Callable[..., torch.Tensor],
                           Callable[..., torch.Tensor | PackedWeight]] | None:
    try:
        op = torch.ops.mkldnn._linear_pointwise
        if not torch.backends.mkldnn.is_available():
            return None
        x, w = torch.ones(2, 4), torch.full((3, 4), 0.5)
        if not torch.allclose(op(x, w, None, "none", [], ""), F.linear(x, w)):
            return None
        if not torch.allclose(op.binary(x, op(x, w, None, "swish", [], ""), w, None, "mul"),
                              _plain_silu_mul(x, w, w)):
            return None
    except (AttributeError, RuntimeError):
        return None
    pack = _onednn_pack(op)
    pack_both = _with_gemv(pack)
    bf16_ok = ops.capabilities().can_run("gemm_bf16")
    # oneDNN without a bfloat16 inner product on this CPU (AVX2 and older: "could not create a
    # primitive descriptor"): bfloat16 matrices take PyTorch's own GEMM instead.
    plain_bf16 = not _onednn_runs(op, torch.bfloat16)

    def linear(x: torch.Tensor, weight: torch.Tensor | PackedWeight,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        if type(weight) is PackedWeight:
            m = x.shape[0]
            if m <= (F32_KERNEL_MAX_ROWS if weight.f32 else GEMV_MAX_ROWS):
                return weight.gemv(x, bias)
            if m <= BF16_KERNEL_MAX_ROWS and bf16_ok and isinstance(weight.gemv, GemvWeight):
                return gemm_bf16(weight.gemv, x, bias)
            weight = weight.onednn
        if plain_bf16 and isinstance(weight, torch.Tensor) and weight.dtype == torch.bfloat16:
            return F.linear(x, weight, bias)
        return op(x, weight, bias, "none", [], "")

    def silu_mul(x: torch.Tensor, gate: torch.Tensor | PackedWeight,
                 up: torch.Tensor | PackedWeight) -> torch.Tensor:
        if type(gate) is PackedWeight:
            m = x.shape[0]
            if gate.gemv.silu_pair:  # from prepack_gate_up
                if m <= (F32_KERNEL_MAX_ROWS if gate.f32 else GEMV_MAX_ROWS):
                    return gate.gemv.silu_mul(x)
                if m <= BF16_KERNEL_MAX_ROWS and bf16_ok and isinstance(gate.gemv, GemvWeight):
                    return gemm_bf16_silu_mul(gate.gemv, x)
            gate = gate.onednn
        if type(up) is PackedWeight:
            up = up.onednn
        if plain_bf16 and isinstance(gate, torch.Tensor) and isinstance(up, torch.Tensor) \
                and gate.dtype == torch.bfloat16:
            return _plain_silu_mul(x, gate, up)
        return op.binary(x, op(x, gate, None, "swish", [], ""), up, None, "mul")

    return linear, silu_mul, pack, pack_both


def _identity(weight: torch.Tensor) -> torch.Tensor:
    return weight


def _onednn_runs(op, dtype: torch.dtype) -> bool:
    """Whether oneDNN's inner product runs in ``dtype`` here (not in bfloat16 on a CPU whose
    oneDNN stops at AVX2: it raises instead)."""
    try:
        x, w = torch.ones(2, 4, dtype=dtype), torch.full((3, 4), 0.5, dtype=dtype)
        return torch.equal(op(x, w, None, "none", [], ""), F.linear(x, w))
    except RuntimeError:
        return False


def _onednn_pack(op) -> Callable[..., torch.Tensor]:
    """oneDNN's weight packing, for each dtype where this torch has it and it gives the plain
    weight's results exactly (with a bias); weights of other dtypes stay as they are."""
    packs: list[torch.dtype] = []
    try:
        reorder = torch.ops.mkldnn._reorder_linear_weight
    except AttributeError:
        return _identity
    for dtype in (torch.float32, torch.bfloat16):
        try:
            x = torch.linspace(-1, 1, 3 * 40).reshape(3, 40).to(dtype)
            w = torch.linspace(-2, 2, 24 * 40).reshape(24, 40).to(dtype)
            b = torch.linspace(0, 1, 24).to(dtype)
            packed = reorder(w, PACK_BATCH_SIZE)
            if torch.equal(op(x, packed, b, "none", [], ""), op(x, w, b, "none", [], "")):
                packs.append(dtype)
        except RuntimeError:  # bfloat16 where oneDNN has no bfloat16 kernel for this CPU
            pass
    if not packs:
        return _identity

    def pack(weight: torch.Tensor) -> torch.Tensor:
        if weight.dtype not in packs or weight.dim() != 2:
            return weight
        return reorder(weight.contiguous(), PACK_BATCH_SIZE)

    return pack


def _with_gemv(pack: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor | PackedWeight]:
    """``pack``, and also the decode-step kernel's copy where it runs: the few-row kernel's
    for bfloat16 matrices, ``gemm_f32``'s for float32 ones."""
    caps = ops.capabilities()
    bf16_ok, f32_ok = caps.can_run("gemv_bf16"), caps.can_run("gemm_f32")
    if pack is _identity or not (bf16_ok or f32_ok):
        return pack

    def pack_both(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
        if weight.dim() == 2 and weight.dtype == torch.bfloat16 and bf16_ok:
            return PackedWeight(pack(weight), GemvWeight(weight))
        if weight.dim() == 2 and weight.dtype == torch.float32 and f32_ok:
            return PackedWeight(pack(weight), GemmF32Weight(weight))
        return pack(weight)

    return pack_both


# The row count oneDNN is told to expect when packing. The layout it picks for 64 rows served
# 1 to 2048 rows as well as a layout packed for each of them (measured on SmolLM2's shapes).
PACK_BATCH_SIZE = 64
_ops = _onednn_ops()
USING_ONEDNN = _ops is not None
# Whether bfloat16 products have a fast path here: oneDNN's bfloat16 inner product (AVX512_BF16,
# AVX-512 or AMX CPUs; not on AVX2 ones). Where not, ``linear`` takes PyTorch's own bfloat16 GEMM,
# which is correct but far slower than float32 (executor/dtype_support.py refuses the dtype).
BF16_FAST = USING_ONEDNN and _onednn_runs(torch.ops.mkldnn._linear_pointwise, torch.bfloat16)
# linear(x, weight, bias=None) = x @ weight.T + bias
linear: Linear = _ops[0] if _ops else _plain_linear
# silu_mul(x, gate, up) = silu(x @ gate.T) * (x @ up.T), the SwiGLU MLP's first half
silu_mul: Callable[..., torch.Tensor] = _ops[1] if _ops else _plain_silu_mul
# prepack(weight) -> the weight in the layout ``linear`` and ``silu_mul`` read fastest (oneDNN's
# blocked layout, an opaque tensor good for nothing else), or the weight itself where there is
# no such layout. Pack once at load, never per call.
prepack: Callable[[torch.Tensor], torch.Tensor | PackedWeight] = _ops[3] if _ops else _identity
_prepack_onednn: Callable[[torch.Tensor], torch.Tensor] = _ops[2] if _ops else _identity


def prepack_gate_up(gate: torch.Tensor, up: torch.Tensor
                    ) -> tuple[torch.Tensor | PackedWeight, torch.Tensor | PackedWeight]:
    """The MLP's gate and up matrices packed for ``silu_mul``: where the few-row kernel runs,
    the gate's ``PackedWeight`` also holds both matrices interleaved for it."""
    if prepack is _prepack_onednn or gate.dim() != 2:
        return prepack(gate), prepack(up)
    if gate.dtype == torch.bfloat16 and ops.capabilities().can_run("gemv_bf16"):
        return PackedWeight(_prepack_onednn(gate), GemvWeight(gate, up)), _prepack_onednn(up)
    if gate.dtype == torch.float32 and ops.capabilities().can_run("gemm_f32"):
        return PackedWeight(_prepack_onednn(gate), GemmF32Weight(gate, up)), _prepack_onednn(up)
    return prepack(gate), prepack(up)
