"""Python side of the bfloat16 few-row GEMM kernel (``gemv_bf16.c``): ``GemvWeight`` owns a
matrix in the kernel's layout and multiplies rows by it.

Decode steps multiply one or a few rows by each weight matrix; there the time is reading the
matrix, and oneDNN's small-row path spends about twice what streaming it costs. The kernel
reads each matrix once per step in one sequential run per 64 output columns. It is used only
where the CPU has AVX512_BF16 (``ops.capabilities()``, kernel ``gemv_bf16``); the caller keeps
oneDNN for other row counts and CPUs. Calls do no checking beyond shapes and dtypes the model cannot get wrong
cheaply: the model passes tensors it allocated itself.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from llmtower.kernels.ops import kernel_library
from llmtower.kernels.huge_pages import empty_streamed

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Rows of gate and of up per kernel tile (half of the kernel's 64 output columns).
SILU_HALF_TILE = 32


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.gemv_bf16_packed_numel.argtypes = [_I64, _I64]
    lib.gemv_bf16_packed_numel.restype = _I64
    lib.gemv_bf16_pack.argtypes = [_P, _I64, _I64, _P]
    lib.gemv_bf16_pack.restype = None
    lib.gemv_bf16.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT]
    lib.gemv_bf16_silu_mul.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT, _INT]
    lib.gemv_bf16.restype = lib.gemv_bf16_silu_mul.restype = _INT
    lib.gemv_bf16_tiles_set_prefetch.argtypes = [_INT, _I64]
    lib.gemv_bf16_tiles_set_prefetch.restype = None
    return lib


# Software prefetch hints of the tile kernel (gemv_bf16_tiles.h): 0 none, 1 NTA, 2 T0, 3 T1, 4 T2.
PREFETCH_HINTS = {"none": 0, "nta": 1, "t0": 2, "t1": 3, "t2": 4}


def set_prefetch(hint: str, dist: int = 1024) -> None:
    """Prefetch the few-row tiles ``dist`` bytes ahead with ``hint`` (``"none"``: off, the
    default), in this kernel and in decode_layer's whole layers: one setting, held once in the
    kernel library (benchmarks compare them; the results do not change)."""
    code = PREFETCH_HINTS[hint]
    if dist < 0:
        raise ValueError("prefetch distance must be >= 0")
    _lib().gemv_bf16_tiles_set_prefetch(code, dist)


def _pack(w: torch.Tensor) -> torch.Tensor:
    n, k = w.shape
    lib = _lib()
    out = empty_streamed(lib.gemv_bf16_packed_numel(n, k), torch.bfloat16)
    lib.gemv_bf16_pack(w.data_ptr(), n, k, out.data_ptr())
    return out


class GemvWeight:
    """Owns one bfloat16 matrix [N, K] in the kernel's tiled layout (``silu_pair``: a gate and
    an up matrix interleaved 32 rows each, for ``silu_mul``); ``path=1`` runs the portable C
    code (tests compare the two)."""

    def __init__(self, weight: torch.Tensor, up: torch.Tensor | None = None, path: int = 0) -> None:
        if weight.dtype != torch.bfloat16 or weight.dim() != 2:
            raise TypeError(f"GemvWeight takes a 2-D bfloat16 matrix, not {weight.dtype} "
                            f"{tuple(weight.shape)}")
        self.n, self.k = weight.shape
        self.path = path
        self.silu_pair = up is not None
        self._lib = _lib()
        if up is not None:
            if up.shape != weight.shape or up.dtype != weight.dtype:
                raise ValueError("gate and up must have one shape and dtype")
            # Tile t: gate rows 32t..32t+31, then up rows 32t..32t+31 (zero rows past N).
            pad = -self.n % SILU_HALF_TILE
            g = _pad_rows(weight, pad).view(-1, SILU_HALF_TILE, self.k)
            u = _pad_rows(up, pad).view(-1, SILU_HALF_TILE, self.k)
            weight = torch.cat([g, u], dim=1).reshape(-1, self.k)
        self.packed = _pack(weight.contiguous())
        self._packed_ptr = self.packed.data_ptr()

    # The two calls below run ~90 times per decode step: their checks are one comparison of
    # the shape and strides the kernel relies on (x.dim() == 2 is implied by the shape pair).
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` in bfloat16 for x [M, K] bfloat16 (rows may be strided)."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k \
                or x.stride(1) != 1 or self.silu_pair:
            self._refuse(x, want_pair=False)
        if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                 or bias.numel() != self.n):
            raise ValueError(f"gemv_bf16: bias must be contiguous bfloat16 [{self.n}]")
        m = x.shape[0]
        out = x.new_empty(m, self.n)
        self._lib.gemv_bf16(x.data_ptr(), m, x.stride(0), self._packed_ptr, self.n, self.k,
                            None if bias is None else bias.data_ptr(), out.data_ptr(), self.n,
                            torch.get_num_threads(), self.path)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` in bfloat16 for x [M, K] bfloat16."""
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.k \
                or x.stride(1) != 1 or not self.silu_pair:
            self._refuse(x, want_pair=True)
        m = x.shape[0]
        out = x.new_empty(m, self.n)
        self._lib.gemv_bf16_silu_mul(x.data_ptr(), m, x.stride(0), self._packed_ptr, self.n,
                                     self.k, out.data_ptr(), self.n, torch.get_num_threads(),
                                     self.path)
        return out

    def _refuse(self, x: torch.Tensor, want_pair: bool) -> None:
        if want_pair != self.silu_pair:
            raise TypeError("this weight holds a gate/up pair: call silu_mul" if self.silu_pair
                            else "this weight is a single matrix: call it, not silu_mul")
        raise ValueError(f"gemv_bf16: x must be bfloat16 [M, {self.k}] with unit column "
                         f"stride, not {x.dtype} {tuple(x.shape)}")


def _pad_rows(w: torch.Tensor, pad: int) -> torch.Tensor:
    """w with ``pad`` zero rows appended."""
    return torch.cat([w, w.new_zeros(pad, w.shape[1])]) if pad else w
