"""Python side of the float32 decode-step GEMM kernel (``gemm_f32.c``): ``GemmF32Weight`` owns
a matrix in the kernel's panel layout and multiplies rows by it.

A float32 decode step multiplies the running requests' rows (tens to a few hundred) by every
weight matrix, which comes from memory each step; oneDNN reaches only 60-85% of its in-cache
rate there. The kernel streams each 32-column panel once per step with the next one prefetched.
It is used only where the build has a vector layer, AVX-512, AVX2+FMA or NEON (``kernels/vec.h``;
``ops.capabilities()``, kernel ``gemm_f32``); the caller keeps oneDNN for other row counts and
CPUs. Calls check only what the model could get wrong cheaply: it passes tensors it allocated itself.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from llmtower.kernels.ops import kernel_library
from llmtower.kernels.huge_pages import empty_streamed

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
# Gate (and up) rows per 32-column panel of a silu pair.
SILU_HALF_PANEL = 16


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.gemm_f32_packed_numel.argtypes = [_I64, _I64, _INT]
    lib.gemm_f32_packed_numel.restype = _I64
    lib.gemm_f32_pack.argtypes = [_P, _P, _I64, _I64, _P]
    lib.gemm_f32_pack.restype = None
    lib.gemm_f32.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT]
    lib.gemm_f32_silu_mul.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT, _INT]
    lib.gemm_f32.restype = lib.gemm_f32_silu_mul.restype = _INT
    return lib


class GemmF32Weight:
    """Owns one float32 matrix [N, K] in the kernel's panel layout (``silu_pair``: a gate and
    an up matrix, 16 rows of each per panel, for ``silu_mul``); ``path=1`` runs the portable C
    code (tests compare the two)."""

    def __init__(self, weight: torch.Tensor, up: torch.Tensor | None = None, path: int = 0) -> None:
        if weight.dtype != torch.float32 or weight.dim() != 2:
            raise TypeError(f"GemmF32Weight takes a 2-D float32 matrix, not {weight.dtype} "
                            f"{tuple(weight.shape)}")
        if up is not None and (up.shape != weight.shape or up.dtype != weight.dtype):
            raise ValueError("gate and up must have one shape and dtype")
        self.n, self.k = weight.shape
        self.path = path
        self.silu_pair = up is not None
        self._lib = _lib()
        weight = weight.contiguous()
        up = up.contiguous() if up is not None else None
        self.packed = empty_streamed(
            self._lib.gemm_f32_packed_numel(self.n, self.k, int(self.silu_pair)), torch.float32)
        self._lib.gemm_f32_pack(weight.data_ptr(), None if up is None else up.data_ptr(),
                                self.n, self.k, self.packed.data_ptr())
        self._packed_ptr = self.packed.data_ptr()

    # Called ~120 times per decode step: one comparison of the shape and stride the kernel
    # relies on (x.dim() == 2 is implied by the shape pair).
    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T + bias`` for x [M, K] float32 (rows may be strided)."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k \
                or x.stride(1) != 1 or self.silu_pair:
            self._refuse(x, want_pair=False)
        if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()
                                 or bias.numel() != self.n):
            raise ValueError(f"gemm_f32: bias must be contiguous float32 [{self.n}]")
        m = x.shape[0]
        out = x.new_empty(m, self.n)
        if self._lib.gemm_f32(x.data_ptr(), m, x.stride(0) if m > 1 else self.k, self._packed_ptr,
                              self.n, self.k, None if bias is None else bias.data_ptr(),
                              out.data_ptr(), self.n, torch.get_num_threads(), self.path):
            self._refuse(x, want_pair=False)
        return out

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """``silu(x @ gate.T) * (x @ up.T)`` for x [M, K] float32."""
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != self.k \
                or x.stride(1) != 1 or not self.silu_pair:
            self._refuse(x, want_pair=True)
        m = x.shape[0]
        out = x.new_empty(m, self.n)
        if self._lib.gemm_f32_silu_mul(x.data_ptr(), m, x.stride(0) if m > 1 else self.k,
                                       self._packed_ptr, self.n, self.k, out.data_ptr(), self.n,
                                       torch.get_num_threads(), self.path):
            self._refuse(x, want_pair=True)
        return out

    def pair_products(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A silu pair's gate and up products ``x @ gate.T``, ``x @ up.T`` (no SiLU), in one
        pass over the pair's panels: each panel is 16 gate then 16 up columns of a plain
        product (LoRA adds to both before the SiLU)."""
        if not self.silu_pair or x.dtype != torch.float32 or x.dim() != 2 \
                or x.shape[1] != self.k or x.stride(1) != 1:
            self._refuse(x, want_pair=True)
        m, panels = x.shape[0], -(-self.n // SILU_HALF_PANEL)
        cols = 2 * SILU_HALF_PANEL * panels
        out = x.new_empty(m, cols)
        if self._lib.gemm_f32(x.data_ptr(), m, x.stride(0) if m > 1 else self.k,
                              self._packed_ptr, cols, self.k, None, out.data_ptr(), cols,
                              torch.get_num_threads(), self.path):
            self._refuse(x, want_pair=True)
        halves = out.view(m, panels, 2, SILU_HALF_PANEL)
        return (halves[:, :, 0].reshape(m, -1)[:, :self.n],
                halves[:, :, 1].reshape(m, -1)[:, :self.n])

    def _refuse(self, x: torch.Tensor, want_pair: bool) -> None:
        if want_pair != self.silu_pair:
            raise TypeError("this weight holds a gate/up pair: call silu_mul" if self.silu_pair
                            else "this weight is a single matrix: call it, not silu_mul")
        raise ValueError(f"gemm_f32: x must be float32 [M, {self.k}] with unit column stride "
                         f"and rows apart (row stride >= {self.k}), not {x.dtype} "
                         f"{tuple(x.shape)} strides {tuple(x.stride())}")
