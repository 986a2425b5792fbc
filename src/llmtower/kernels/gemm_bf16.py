"""Python side of the bfloat16 decode-step GEMM kernel (``gemm_bf16.c``): products of tens to a
few hundred rows by a matrix the few-row kernel already holds (``GemvWeight``: the same packed
buffer, no second copy), summed as that kernel sums them (a row's result does not depend on
which of the two ran it, nor on the row or thread count).

Used only where the CPU has AVX512_BF16 (``ops.capabilities()``, kernel ``gemm_bf16``); the
caller keeps oneDNN for other row counts and CPUs. Calls check only what the model could get
wrong cheaply.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from llmtower.kernels.ops import kernel_library
from llmtower.kernels.gemv_bf16 import GemvWeight

_P, _I64, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.gemm_bf16.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _INT, _INT]
    lib.gemm_bf16_silu_mul.argtypes = [_P, _I64, _I64, _P, _I64, _I64, _P, _I64, _INT, _INT]
    lib.gemm_bf16.restype = lib.gemm_bf16_silu_mul.restype = _INT
    return lib


def _check(w: GemvWeight, x: torch.Tensor, want_pair: bool) -> None:
    if want_pair != w.silu_pair:
        raise TypeError("this weight holds a gate/up pair: call gemm_bf16_silu_mul" if w.silu_pair
                        else "this weight is a single matrix: call gemm_bf16, not silu_mul")
    raise ValueError(f"gemm_bf16: x must be bfloat16 [M, {w.k}] with unit column stride and "
                     f"rows apart, not {x.dtype} {tuple(x.shape)} strides {tuple(x.stride())}")


# Called ~120 times per decode step: one comparison of the shape and strides the kernel relies
# on (x.dim() == 2 is implied by the shape pair).
def gemm_bf16(w: GemvWeight, x: torch.Tensor, bias: torch.Tensor | None = None,
              path: int | None = None) -> torch.Tensor:
    """``x @ W.T + bias`` in bfloat16 for x [M, K] bfloat16 (rows may be strided); ``path=1``
    runs the portable C code (default: the weight's)."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1 \
            or w.silu_pair:
        _check(w, x, want_pair=False)
    if bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                             or bias.numel() != w.n):
        raise ValueError(f"gemm_bf16: bias must be contiguous bfloat16 [{w.n}]")
    m = x.shape[0]
    out = x.new_empty(m, w.n)
    if _lib().gemm_bf16(x.data_ptr(), m, x.stride(0) if m > 1 else w.k, w.packed.data_ptr(),
                        w.n, w.k, None if bias is None else bias.data_ptr(), out.data_ptr(), w.n,
                        torch.get_num_threads(), w.path if path is None else path):
        _check(w, x, want_pair=False)
    return out


def gemm_bf16_silu_mul(w: GemvWeight, x: torch.Tensor, path: int | None = None) -> torch.Tensor:
    """``silu(x @ gate.T) * (x @ up.T)`` in bfloat16 for x [M, K] bfloat16 and a gate/up
    ``GemvWeight``."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != w.k or x.stride(1) != 1 \
            or not w.silu_pair:
        _check(w, x, want_pair=True)
    m = x.shape[0]
    out = x.new_empty(m, w.n)
    if _lib().gemm_bf16_silu_mul(x.data_ptr(), m, x.stride(0) if m > 1 else w.k,
                                 w.packed.data_ptr(), w.n, w.k, out.data_ptr(), w.n,
                                 torch.get_num_threads(), w.path if path is None else path):
        _check(w, x, want_pair=True)
    return out
