"""Python side of the fused per-layer kernels (``fused_ops.c``): ``FusedOps`` runs them.

The calls sit on the hottest path of a decode step (three per layer), so they do no checking
of their own: ``FusedOps.check_step`` validates once per step what the C code trusts (positions
inside the rotary tables, slots inside the KV cache, dtypes and layouts), and the model only
passes tensors it allocated itself. ctypes releases the GIL for each call.
"""
from __future__ import annotations

import ctypes
import functools

import torch

from llmtower.kernels.ops import kernel_library

_P, _I64, _F, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
DTYPES = {torch.float32: 0, torch.bfloat16: 1}


@functools.cache
def _lib() -> ctypes.CDLL:
    lib = kernel_library()
    lib.add_rms_norm.argtypes = [_P, _P, _P, _P, _I64, _I64, _F, _INT, _INT]
    lib.rope_kv_write.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _P,
                                  _P, _INT, _INT]
    lib.silu_mul.argtypes = [_P, _P, _I64, _I64, _INT, _INT]
    for f in (lib.add_rms_norm, lib.rope_kv_write, lib.silu_mul):
        f.restype = _INT
    return lib


class FusedOps:
    """Owns the loaded kernels for one dtype and the thread count they use."""

    def __init__(self, dtype: torch.dtype) -> None:
        if dtype not in DTYPES:
            raise TypeError(f"the fused kernels run float32 or bfloat16, not {dtype}")
        lib = _lib()
        self.dtype = dtype
        self._bf16 = DTYPES[dtype]
        self._norm = lib.add_rms_norm
        self._rope = lib.rope_kv_write
        self._silu = lib.silu_mul

    def check_step(self, positions: torch.Tensor, slots: torch.Tensor, max_position: int,
                   num_slots: int) -> None:
        """Once per step: every index the kernels will follow is inside its table."""
        if positions.dtype != torch.int64 or slots.dtype != torch.int64 \
                or not positions.is_contiguous() or not slots.is_contiguous() \
                or positions.shape != slots.shape:
            raise ValueError("fused ops: positions and slots must be contiguous int64 of one length")
        if positions.numel():
            if int(positions.min()) < 0 or int(positions.max()) >= max_position:
                raise ValueError(f"fused ops: positions must be in 0..{max_position - 1}")
            if int(slots.min()) < 0 or int(slots.max()) >= num_slots:
                raise ValueError(f"fused ops: KV slots must be in 0..{num_slots - 1}")

    def add_rms_norm(self, residual: torch.Tensor, x: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """``residual += x`` (in place, when x is given), then RMSNorm(residual) * weight."""
        t, h = residual.shape
        out = torch.empty_like(residual)
        self._norm(residual.data_ptr(), None if x is None else x.data_ptr(), weight.data_ptr(),
                   out.data_ptr(), t, h, eps, self._bf16, torch.get_num_threads())
        return out

    def rope_kv_write(self, qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
                      cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                      slots: torch.Tensor, kv_cache: torch.Tensor, want_k: bool
                      ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rotated q [T, H, D] (and k [T, Hkv, D] when ``want_k``); k and v written to their
        slots of ``kv_cache`` [2, blocks, block_size, Hkv, D]."""
        t = qkv.shape[0]
        k_ptr = kv_cache.data_ptr()  # K, then V one stride(0) further: no indexing ops
        q = qkv.new_empty(t, num_heads, head_dim)
        k = qkv.new_empty(t, num_kv_heads, head_dim) if want_k else None
        self._rope(qkv.data_ptr(), qkv.stride(0), t, num_heads, num_kv_heads, head_dim,
                   cos.data_ptr(), sin.data_ptr(), positions.data_ptr(), slots.data_ptr(),
                   k_ptr, k_ptr + kv_cache.stride(0) * kv_cache.element_size(), q.data_ptr(),
                   None if k is None else k.data_ptr(), self._bf16, torch.get_num_threads())
        return q, k

    def silu_mul(self, y: torch.Tensor) -> torch.Tensor:
        """silu(y[:, :I]) * y[:, I:] for y [T, 2I] contiguous."""
        t, n2 = y.shape
        out = y.new_empty(t, n2 // 2)
        self._silu(y.data_ptr(), out.data_ptr(), t, n2 // 2, self._bf16, torch.get_num_threads())
        return out
