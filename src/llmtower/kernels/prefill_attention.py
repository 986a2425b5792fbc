"""Python side of the bfloat16 causal prefill-attention kernel (``prefill_attention.c``).

``prefill_attention(q, k, v, out, scale, num_threads)`` checks every shape, dtype and layout
the C code trusts, then calls it (ctypes releases the GIL). Where it cannot run (no compiler, or
a CPU without AVX-512 BF16: ``ops.capabilities()``, kernel ``prefill_bf16``), callers keep
PyTorch's SDPA.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from llmtower.kernels.ops import kernel_library
from llmtower.kernels.paged_attention import raise_for_code

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


def load_prefill_kernel(entry: str) -> Callable[..., int]:
    """A prefill-attention kernel's entry point (both share one C signature)."""
    f = getattr(kernel_library(), entry)
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _I64, _P, _I64, _P, _I64, _I64, _I64, _I64, ctypes.c_float,
                  ctypes.c_int]
    return f


@functools.cache
def _fn() -> Callable[..., int]:
    return load_prefill_kernel("prefill_attention")


def prefill_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this attention shape (head_dim a multiple of 32, up to 512)."""
    return head_dim % 32 == 0 and head_dim <= 512 and num_kv_heads >= 1 \
        and num_heads % num_kv_heads == 0


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                      scale: float, num_threads: int) -> torch.Tensor:
    """Causal attention of a chunk starting at position 0: q [n, H, D], k/v [n, Hkv, D]
    (rows may be strided; heads and dims contiguous), out [n, H, D] contiguous; all bfloat16.
    Row i of q attends to rows 0..i of k and v; query head h to KV head h // (H // Hkv)."""
    return checked_prefill_call(
        "prefill_attention", torch.bfloat16, prefill_shape_ok,
        "head_dim a multiple of 32 (<= 512)", _fn, q, k, v, out, scale, num_threads)


def checked_prefill_call(name: str, dtype: torch.dtype, shape_ok: Callable[[int, int, int], bool],
                         shape_rule: str, fn: Callable[[], Callable[..., int]], q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, scale: float,
                         num_threads: int) -> torch.Tensor:
    """Checks every shape, dtype and layout a prefill-attention kernel (this one, or its
    float32 sibling in ``prefill_attention_f32.py``: same C signature) trusts, then calls it."""
    n, h, d = q.shape
    hkv = k.shape[1]
    for arg, x in (("q", q), ("k", k), ("v", v), ("out", out)):
        if x.dtype != dtype:
            raise TypeError(f"{name}: {arg} is {x.dtype}; the kernel runs {str(dtype)[6:]}")
        if x.dim() != 3 or x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError(f"{name}: {arg} must be [rows, heads, dims] with its heads and "
                             "dims contiguous")
    if k.shape != v.shape or k.shape[0] != n or k.shape[2] != d or tuple(out.shape) != (n, h, d):
        raise ValueError(f"{name}: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, out {tuple(out.shape)} do not fit together")
    if not out.is_contiguous():
        raise ValueError(f"{name}: out must be contiguous")
    if not shape_ok(h, hkv, d):
        raise ValueError(f"{name}: {h} heads / {hkv} KV heads of {d} dims: the kernel needs "
                         f"{shape_rule} and heads a multiple of KV heads")
    if n == 0:
        return out
    rc = fn()(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
              out.data_ptr(), n, h, hkv, d, scale, num_threads)
    raise_for_code(name, rc)
    return out
