"""Linear layers whose weights stay in a GGUF file's block formats (``--quantization gguf``).

A GGUF tensor reaches the model as a ``GGUFMatrix``: where its bytes lie in the file, not the
bytes themselves. The model fuses q/k/v (and gate/up) by handing the parts to
``block_linear``, which reads each run of same-format parts straight from the file into one
buffer of its own, on huge pages where Linux gives them (``kernels/huge_pages.py``: decode
streams every weight once per step). So a weight is held once, in the file's own format,
and nothing is dequantized: ``kernels/quant_gemm.c`` multiplies by the blocks. The file is read
with ordinary reads, not through a mapping, so its pages count once (in the page cache) and
not again in this process.

Parts in formats without a block kernel (Q5_0, Q5_1, Q2_K, Q3_K), or where the kernel's fast
code is missing (x86 below x86-64-v3; it exists for AVX2, AVX-512 and aarch64 NEON), are
dequantized per tensor to the model's dtype and take the float path: one tensor at a time,
never a float32 copy of the whole model.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmtower.kernels import ops
from llmtower.kernels.huge_pages import empty_streamed
from llmtower.kernels.quant_gemm import BLOCK_FORMATS, BlockWeight, quantize_activations
from llmtower.models.gguf_dequant import dequantize
from llmtower.models import linear as linear_ops
from llmtower.utils import cpu_info


@dataclass(frozen=True)
class GGUFMatrix:
    """Owns the location of one 2-D GGUF tensor [N, K] in block format ``fmt`` (a ggml type
    id): ``offset`` bytes into ``path``, rows of ``row_bytes``; ``row_order``: the file's row
    for each of ours (llama.cpp's q/k permutation undone), None for the identity."""

    path: Path
    offset: int
    fmt: int
    n: int
    k: int
    row_order: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return (self.n, self.k)

    @property
    def row_bytes(self) -> int:
        values, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(self.fmt)]
        return self.k // values * nbytes

    @property
    def nbytes(self) -> int:
        return self.n * self.row_bytes

    @property
    def type_name(self) -> str:
        return GGMLQuantizationType(self.fmt).name

    def read_into(self, out: np.ndarray) -> None:
        """The tensor's bytes, rows in our order, into ``out`` (uint8, ``nbytes``)."""
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            if self.row_order is None:
                if f.readinto(out.data) != self.nbytes:
                    raise ValueError(f"{self.path} ends inside a tensor: the file is truncated")
                return
            raw = np.empty((self.n, self.row_bytes), dtype=np.uint8)
            if f.readinto(raw.data) != self.nbytes:
                raise ValueError(f"{self.path} ends inside a tensor: the file is truncated")
        out.reshape(self.n, self.row_bytes)[:] = raw[self.row_order]

    def weight(self) -> BlockWeight:
        """The matrix read into a buffer of its own, for the block kernel."""
        return _read_parts([self])

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """The float matrix in ``dtype`` (gguf's reference values, rounded once to dtype):
        the block kernel's exact decoder where the format has one, else gguf's."""
        if self.fmt in BLOCK_FORMATS:
            return self.weight().dequantize().to(dtype)
        raw = np.empty(self.nbytes, dtype=np.uint8)
        self.read_into(raw)
        qtype = GGMLQuantizationType(self.fmt)
        if qtype == GGMLQuantizationType.F32:
            w = torch.from_numpy(raw.view(np.float32).reshape(self.n, self.k))
        elif qtype == GGMLQuantizationType.F16:
            w = torch.from_numpy(raw.view(np.float16).reshape(self.n, self.k))
        else:
            w = torch.from_numpy(dequantize(raw.reshape(self.n, self.row_bytes), qtype))
        return w.to(dtype)


def has_block_kernel(fmt: int) -> bool:
    """Whether products by format ``fmt`` run on the block kernel here."""
    return fmt in BLOCK_FORMATS and ops.capabilities().can_run("quant_gemm")


def _read_parts(parts: list[GGUFMatrix]) -> BlockWeight:
    """Same-format parts stacked along their rows, read into one buffer."""
    first = parts[0]
    total = sum(p.nbytes for p in parts)
    buf = empty_streamed(total, torch.uint8)
    view = buf.numpy()
    at = 0
    for p in parts:
        p.read_into(view[at:at + p.nbytes])
        at += p.nbytes
    return BlockWeight(first.fmt, buf, sum(p.n for p in parts), first.k)


class BlockQuantLinear:
    """Owns one linear layer's weight [N, K] as block-format runs stacked along N (q, k, v of
    different formats stay apart: ``parts``); ``__call__(x, bias)`` is ``x @ W.T + bias`` in
    x's dtype, the activations quantized to int8 once for all parts."""

    def __init__(self, parts: list[BlockWeight]) -> None:
        ks = {p.k for p in parts}
        if len(ks) != 1:
            raise ValueError(f"fused matrices must share K, not {sorted(ks)}")
        self.parts = parts
        self.in_features = parts[0].k
        self.out_features = sum(p.n for p in parts)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        m = x.shape[0]
        if all(m > int8_max_rows(p.fmt) for p in self.parts):
            return self._dequantized_product(x, bias)
        # each part by the int8 kernel up to its format's row limit, beyond it by bfloat16
        # slabs (int8_max_rows); the activations' int8 forms are made once for all parts
        act = quantize_activations(x)
        out = torch.empty(m, self.out_features, dtype=torch.float32)
        threads = torch.get_num_threads()
        xb: torch.Tensor | None = None  # x in bfloat16, made once for the slab parts
        at = 0
        for p in self.parts:
            if m > int8_max_rows(p.fmt):
                if xb is None:
                    xb = x.to(torch.bfloat16)
                out[:, at:at + p.n] = self._slabs(xb, p)
            else:
                p.matmul_into(act, out[:, at:], threads)
            at += p.n
        if bias is not None:
            out += bias
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def _slabs(self, xb: torch.Tensor, p: BlockWeight) -> torch.Tensor:
        """xb @ p.T (bfloat16 rows) with p dequantized a slab of rows at a time."""
        out = torch.empty(xb.shape[0], p.n, dtype=xb.dtype)
        step = max(DEQUANT_SLAB_MIN_ROWS, DEQUANT_SLAB_BYTES // (2 * self.in_features))
        for start in range(0, p.n, step):
            end = min(start + step, p.n)
            out[:, start:end] = linear_ops.linear(xb, p.rows(start, end).dequantize(dtype=torch.bfloat16))
        return out

    def _dequantized_product(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Many rows (a prefill chunk): the weight dequantized to bfloat16 for this call and
        multiplied by oneDNN's GEMM (AMX / AVX512_BF16), which beats the int8 kernel once the
        dequantization is shared by enough rows. A slab of rows at a time, straight to bfloat16,
        so the copy stays at tens of MiB: a whole 8B gate/up matrix in float32 then bfloat16
        was 705 MB at every chunk, the process's peak memory, and fresh pages each time."""
        xb = x.to(torch.bfloat16)
        out = torch.empty(x.shape[0], self.out_features, dtype=x.dtype)
        at = 0
        for p in self.parts:
            out[:, at:at + p.n] = self._slabs(xb, p)
            at += p.n
        if bias is not None:
            out += bias
        return out


# The bfloat16 slab of a weight dequantized at once for a prefill product (BlockQuantLinear),
# and its fewest rows: oneDNN's bfloat16 GEMM loses efficiency on narrow weights (an 8B
# gate/up matrix, 144 rows, one process, CPU time: whole 0.17 s, 2048-row slabs 0.27 s,
# 512-row slabs 0.94 s; the dequantization 0.65 s in each case).
DEQUANT_SLAB_BYTES = 32 * 2**20
DEQUANT_SLAB_MIN_ROWS = 2048

# Products of more rows than this dequantize the weight per call (BlockQuantLinear) where the
# CPU has AMX (oneDNN's bfloat16 GEMM on tiles): CPU time per 16384 x 2048 matrix (Q4_0,
# Q4_K) crossed over between 64 and 144 rows there (kernel 160-170 vs 245-300 ms at 64,
# 340-370 vs 250-270 at 144, measured under heavy load). It is also the most rows of a decode
# step for the fused GGUF layer (kernels/quant_layer.c), every part by the int8 kernel.
BLOCK_KERNEL_MAX_ROWS = 96
# Without AMX (oneDNN's bfloat16 on AVX512_BF16, AMD Zen here) the int8 kernel wins further:
# wall ms, benchmarks/gguf_prefill_products.py, int8 vs bfloat16 slabs, 2 threads. Q4_0 gate/up
# [16384x2048] at 144 / 256 / 384 rows: 24 vs 42 / 42 vs 51 / 60 vs 63; 1 thread at 144: 48 vs
# 98; since its blocks are transposed once per chunk for all rows (kernels/quant_gemm_16.c)
# at 512 rows 112 vs 178 (load 2.2). The K formats since their 16-weight-row code (kernels/quant_gemm_k16.c), at 144 / 384 /
# 512 rows: Q4_K gate/up 78 vs 250 / 176 vs 350 / 106 vs 230, Q6_K down [2048x8192] 60 vs 170
# / 92 vs 181 / 136 vs 209 (load 5-8), so a whole 512-token chunk (GGUF_TOKEN_BUDGET) stays on
# the int8 kernel; the other formats were not measured.
INT8_MAX_ROWS_NO_AMX = {2: 512, 12: 512, 13: 512, 14: 512}


def _has_amx() -> bool:
    return "amx_bf16" in cpu_info().flags


def int8_max_rows(fmt: int) -> int:
    """Most rows of x a product by a matrix of ggml type ``fmt`` takes on the int8 kernel
    (more: bfloat16 slabs and oneDNN). Without a fast bfloat16 GEMM (AVX2-only CPUs, where
    PyTorch's own takes 4-6x float32's time) every row count stays on the int8 kernel: its
    AVX2 code runs at about the float32 FMA rate on a prefill chunk (75-115 GOP/s a core,
    docs/performance.md), with no copy of the weight."""
    if not linear_ops.BF16_FAST:
        return 1 << 62
    if _has_amx():
        return BLOCK_KERNEL_MAX_ROWS
    return max(BLOCK_KERNEL_MAX_ROWS, INT8_MAX_ROWS_NO_AMX.get(fmt, BLOCK_KERNEL_MAX_ROWS))


def block_linear(parts: list[GGUFMatrix]) -> BlockQuantLinear:
    """One linear layer over ``parts`` stacked along their rows; runs of one format share a
    buffer (all of q/k/v when the file stores them alike)."""
    runs: list[list[GGUFMatrix]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    return BlockQuantLinear([_read_parts(r) for r in runs])


class BlockEmbedding:
    """Owns the token embeddings as a block-format matrix [V, hidden]; a lookup dequantizes
    only the rows asked for. ``linear`` is the same matrix as an output layer (tied
    embeddings: one copy for both)."""

    def __init__(self, weight: BlockWeight) -> None:
        self.weight = weight
        self.linear = BlockQuantLinear([weight])

    @property
    def shape(self) -> tuple[int, int]:
        return self.weight.shape

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        rows = self.weight.dequantize(ids)
        return rows if dtype == torch.float32 else rows.to(dtype)
