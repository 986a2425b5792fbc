"""Python side of the float32 causal prefill-attention kernel (``prefill_attention_f32.c``).

``prefill_attention_f32(q, k, v, out, scale, num_threads)`` checks every shape, dtype and
layout the C code trusts, then calls it (ctypes releases the GIL). ``prefill_f32_error()`` says
why the kernel cannot run here (no compiler, or a CPU without AVX-512): callers then keep
PyTorch's SDPA.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from llmtower.kernels.build import KernelUnavailable, load

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _fn() -> Callable[..., int]:
    lib = load("prefill_attention_f32")
    lib.prefill_f32_supported.restype = ctypes.c_int
    if not lib.prefill_f32_supported():
        raise KernelUnavailable("the float32 prefill-attention kernel needs a CPU (and a "
                                "compiler target) with AVX-512")
    f = lib.prefill_attention_f32
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, ctypes.c_float,
                  ctypes.c_int]
    return f


def prefill_f32_error() -> str | None:
    """Why the kernel cannot run here, or None when it can (builds it on first call)."""
    try:
        _fn()
    except KernelUnavailable as e:
        return str(e)
    return None


def prefill_f32_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this attention shape (head_dim a multiple of 16)."""
    return head_dim % 16 == 0 and head_dim >= 16 and num_kv_heads >= 1 \
        and num_heads % num_kv_heads == 0


def prefill_attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          scale: float, num_threads: int) -> torch.Tensor:
    """Causal attention of a chunk starting at position 0: q [n, H, D], k/v [n, Hkv, D]
    (rows may be strided; heads and dims contiguous), out [n, H, D] contiguous; all float32.
    Row i of q attends to rows 0..i of k and v; query head h to KV head h // (H // Hkv)."""
    n, h, d = q.shape
    hkv = k.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.dtype != torch.float32:
            raise TypeError(f"prefill_attention_f32: {name} is {x.dtype}; the kernel runs float32")
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"prefill_attention_f32: {name} must be [rows, heads, dims] with "
                             "its heads and dims contiguous")
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or tuple(out.shape) != (n, h, d):
        raise ValueError(f"prefill_attention_f32: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, out {tuple(out.shape)} do not fit together")
    if not out.is_contiguous():
        raise ValueError("prefill_attention_f32: out must be contiguous")
    if not prefill_f32_shape_ok(h, hkv, d):
        raise ValueError(f"prefill_attention_f32: {h} heads / {hkv} KV heads of {d} dims: the "
                         "kernel needs head_dim a multiple of 16 and heads a multiple of KV heads")
    if n == 0:
        return out
    rc = _fn()(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
               out.data_ptr(), n, h, hkv, d, scale, num_threads)
    if rc == -1:
        raise MemoryError("prefill_attention_f32: the kernel could not allocate its scratch buffers")
    if rc != 0:
        raise RuntimeError(f"prefill_attention_f32: the kernel refused its inputs (code {rc})")
    return out
