"""Weights kept quantized: int4 (groups of 32 with a scale and a zero point) and int8 (one
scale per output channel), multiplied by torch's CPU weight-only kernels.

Two stages, because fusing q/k/v (and gate/up) concatenates matrices along their rows, and the
packed int4 layout of ``_convert_weight_to_int4pack_for_cpu`` is not one that concatenates:

- ``QuantizedTensor``: the plain integers and their per-group (or per-row) float32 scales, as
  read from a GGUF block or computed from float weights. ``dequantize()`` gives the float
  matrix these integers stand for, the reference the quantized model is compared with.
- ``QuantizedLinear``: the packed form one ``linear`` call multiplies by
  (``_weight_int4pack_mm_for_cpu`` / ``_weight_int8pack_mm``).

Both kernels are fast only with bfloat16 activations on CPU (their float32 paths are 10-50x
slower here), so a ``QuantizedLinear`` computes in bfloat16: a float32 model casts the
activations in and the result back out around each product. Its scales are stored in bfloat16,
which rounds a GGUF's float16 scales (8 of 11 significant bits kept): that is part of what the
reported error against the dequantized float model measures.

torch's kernels are GEMV kernels: for a step of many rows (a long prefill chunk) each layer's
matrix is instead dequantized to bfloat16 once for that step and multiplied by oneDNN's GEMM
(``DEQUANTIZE_MIN_ROWS``). Measured at 2 threads on SmolLM2's fused gate/up (3072 x 576):
int4 kernel 6.4 ms at 512 rows and 26.6 ms at 2048, against 1.6 ms to dequantize plus 1.9 and
7.5 ms of bfloat16 GEMM; at 144 rows the kernel still wins (1.8 vs 0.55 + 1.6 ms). The weight
then carries bfloat16's rounding (the kernel dequantizes to float32), so such rows differ from
the kernel's by about that much; decode steps are never this large at the default budget.

int4 maps GGUF's Q4_0 (``d * (q - 8)``) and Q4_1 (``d * q + m``) exactly onto torch's
``(q - 8) * scale + zero`` with groups of 32 (Q4_1: ``zero = m + 8 d``). Q8_0's per-block
scales have no torch kernel: such weights are re-quantized to int8 per output channel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from llmtower.kernels.huge_pages import to_huge_pages
from llmtower.models.linear import linear

QuantKind = Literal["int4", "int8"]
QUANTIZATION_METHODS = ("none", "int8", "int4", "gguf")
INT4_GROUP = 32
# _convert_weight_to_int4pack_for_cpu wants the output dimension in multiples of 16.
_INT4_ROW_MULTIPLE = 16
# _weight_int8pack_mm reads the input dimension 16 at a time with no tail: for K = 200 it read
# past the rows (NaNs, segfaults; torch 2.13 CPU). Such matrices get zero columns up to a
# multiple of 16, and the activations too, per call (a few rows: a small copy).
_INT8_COLUMN_MULTIPLE = 16
# Rows from which a product dequantizes the weight to bfloat16 for oneDNN's GEMM (see above).
DEQUANTIZE_MIN_ROWS = 256


@dataclass
class QuantizedTensor:
    """Owns one matrix [N, K] in quantized form before packing.

    int4: ``q`` uint8 in 0..15, ``scale``/``zero`` float32 [N, K // group]; a value is
    ``(q - 8) * scale + zero``. int8: ``q`` int8, ``scale`` float32 [N, 1], ``zero`` None; a value
    is ``q * scale``.
    """

    kind: QuantKind
    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return (int(self.q.shape[0]), int(self.q.shape[1]))

    def dequantize(self) -> torch.Tensor:
        """The float32 matrix these integers stand for."""
        if self.kind == "int8":
            return self.q.to(torch.float32) * self.scale
        n, k = self.shape
        g = self.group_size
        assert self.zero is not None
        q = self.q.to(torch.float32).view(n, k // g, g) - 8.0
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> QuantizedTensor:
        """The rows ``index`` (e.g. undoing llama.cpp's q/k row permutation)."""
        return QuantizedTensor(self.kind, self.q[index], self.scale[index],
                               None if self.zero is None else self.zero[index], self.group_size)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Stack matrices of one kind and group size along their rows (fused q/k/v, gate/up)."""
        first = parts[0]
        if any(p.kind != first.kind or p.group_size != first.group_size for p in parts):
            raise ValueError("cannot fuse quantized matrices of different kinds or group sizes")
        zero = None if first.zero is None else torch.cat([p.zero for p in parts])  # type: ignore[misc]
        return QuantizedTensor(first.kind, torch.cat([p.q for p in parts]),
                               torch.cat([p.scale for p in parts]), zero, first.group_size)


def quantize_int8(w: torch.Tensor) -> QuantizedTensor:
    """Symmetric int8 with one scale per output row: ``scale = max|w_row| / 127``."""
    w = w.to(torch.float32)
    scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
    q = torch.round(w / scale).clamp_(-127, 127).to(torch.int8)
    return QuantizedTensor("int8", q, scale, None, int(w.shape[1]))


def quantize_int4(w: torch.Tensor, group_size: int = INT4_GROUP) -> QuantizedTensor:
    """Asymmetric int4 over groups of ``group_size`` columns, as GGUF's Q4_1: each group's
    minimum and maximum span the 16 levels."""
    w = w.to(torch.float32)
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"int4 needs the input dimension ({k}) in multiples of {group_size}")
    g = w.view(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15.0).clamp_min(1e-12)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return QuantizedTensor("int4", q.view(n, k), scale, lo + 8.0 * scale, group_size)


def int4_supported(shape: tuple[int, int], group_size: int = INT4_GROUP) -> bool:
    """Whether torch's CPU int4 kernel takes a [N, K] matrix."""
    n, k = shape
    return n % _INT4_ROW_MULTIPLE == 0 and k % group_size == 0


class QuantizedLinear:
    """Owns one packed quantized weight [N, K]; ``__call__(x, bias)`` is ``x @ W.T + bias`` with
    ``W`` its dequantized matrix, computed in bfloat16 with float32 accumulation, returned in
    ``x``'s dtype."""

    COMPUTE_DTYPE = torch.bfloat16

    def __init__(self, t: QuantizedTensor) -> None:
        self.kind: QuantKind = t.kind
        self.out_features, self.in_features = t.shape
        self.group_size = t.group_size
        cd = self.COMPUTE_DTYPE
        # For many-row products: the integers (int4: two to a byte) and their scales, to
        # dequantize from in a few passes (the packed int4 layout is the kernel's own).
        self._q = t.q.contiguous()
        self._scale = t.scale.to(cd).contiguous()
        self._zero = None if t.zero is None else t.zero.to(cd).contiguous()
        self._k_pad = 0
        if t.kind == "int4":
            self._q = (t.q[:, 0::2] | (t.q[:, 1::2] << 4)).contiguous()
            if not int4_supported(t.shape, t.group_size):
                raise ValueError(f"torch's int4 kernel cannot take a {t.shape} matrix "
                                 f"(rows in multiples of {_INT4_ROW_MULTIPLE}, columns of "
                                 f"{t.group_size})")
            assert t.zero is not None
            # On huge pages, as the float kernels' weights (kernels/huge_pages.py).
            self.weight = to_huge_pages(torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                t.q.to(torch.int32).contiguous(), 1))
            # [K // group, N, 2]: (scale, zero) of each group of each output channel.
            self.scales = torch.stack([t.scale.t(), t.zero.t()], dim=-1).to(cd).contiguous()
        else:
            self._k_pad = -self.in_features % _INT8_COLUMN_MULTIPLE  # int8 only
            self.weight = to_huge_pages(F.pad(t.q, (0, self._k_pad)).contiguous())
            self.scales = t.scale.view(-1).to(cd).contiguous()

    @property
    def nbytes(self) -> int:
        extra = self._q.nbytes + self._scale.nbytes + (
            0 if self._zero is None else self._zero.nbytes)
        return self.weight.nbytes + self.scales.nbytes + extra

    def dequantized(self) -> torch.Tensor:
        """The matrix in bfloat16: ``(q - 8) * scale + zero`` (int4) or ``q * scale`` (int8),
        rounded once."""
        n, k = self.out_features, self.in_features
        if self.kind == "int8":
            return self._q.to(self.COMPUTE_DTYPE) * self._scale.view(n, 1)
        assert self._zero is not None
        q = torch.stack([self._q & 15, self._q >> 4], dim=-1).view(n, k // self.group_size,
                                                                  self.group_size)
        g = k // self.group_size
        return torch.addcmul(self._zero.view(n, g, 1), q.to(self.COMPUTE_DTYPE) - 8,
                             self._scale.view(n, g, 1)).view(n, k)

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        dtype = x.dtype
        xc = x if dtype == self.COMPUTE_DTYPE else x.to(self.COMPUTE_DTYPE)
        if x.shape[0] >= DEQUANTIZE_MIN_ROWS:
            y = linear(xc, self.dequantized())
        elif self.kind == "int4":
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xc, self.weight, self.group_size,
                                                            self.scales)
        else:
            if self._k_pad:
                xc = F.pad(xc, (0, self._k_pad))
            y = torch.ops.aten._weight_int8pack_mm(xc, self.weight, self.scales)
        if y.dtype != dtype:
            y = y.to(dtype)
        if bias is not None:
            y = y + bias
        return y


def pack(t: QuantizedTensor) -> QuantizedLinear:
    """The packed form of ``t``; int4 matrices the kernel cannot take fall back to int8."""
    if t.kind == "int4" and not int4_supported(t.shape, t.group_size):
        t = quantize_int8(t.dequantize())
    return QuantizedLinear(t)


def quantize(w: torch.Tensor, kind: QuantKind) -> QuantizedTensor:
    """A float matrix quantized as ``kind``; int4 where the kernel takes its shape, else int8."""
    if kind == "int4" and int4_supported((int(w.shape[0]), int(w.shape[1]))):
        return quantize_int4(w)
    return quantize_int8(w)
