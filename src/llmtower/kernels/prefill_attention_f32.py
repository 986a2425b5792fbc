"""Python side of the float32 causal prefill-attention kernel (``prefill_attention_f32.c``).

``prefill_attention_f32(q, k, v, out, scale, num_threads)`` checks every shape, dtype and
layout the C code trusts, then calls it (ctypes releases the GIL). Where it cannot run (no
compiler, or a build without vec.h's vector layer, LLMTOWER_CPU_ISA=v2: ``ops.capabilities()``,
kernel ``prefill_f32``), callers keep PyTorch's SDPA.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from llmtower.kernels.prefill_attention import checked_prefill_call, load_prefill_kernel


@functools.cache
def _fn() -> Callable[..., int]:
    return load_prefill_kernel("prefill_attention_f32")


def prefill_f32_shape_ok(num_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the kernel takes this attention shape (head_dim a multiple of 16)."""
    return head_dim % 16 == 0 and head_dim >= 16 and num_kv_heads >= 1 \
        and num_heads % num_kv_heads == 0


def prefill_attention_f32(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          scale: float, num_threads: int) -> torch.Tensor:
    """Causal attention of a chunk starting at position 0: q [n, H, D], k/v [n, Hkv, D]
    (rows may be strided; heads and dims contiguous), out [n, H, D] contiguous; all float32.
    Row i of q attends to rows 0..i of k and v; query head h to KV head h // (H // Hkv)."""
    return checked_prefill_call(
        "prefill_attention_f32", torch.float32, prefill_f32_shape_ok,
        "head_dim a multiple of 16", _fn, q, k, v, out, scale, num_threads)
