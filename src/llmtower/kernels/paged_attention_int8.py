"""Python side of decode attention over a KV cache stored in another dtype than the model's
(``--kv-cache-dtype``): the int8 C kernel (``paged_attention_int8.c``) for int8 caches, and the
bfloat16 kernel of ``paged_attention.py`` for a bfloat16 cache under a float32 model.

As in ``paged_attention.py``, everything the C code trusts is checked here first.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from llmtower.kernels.kv_quant import group_size, row_width
from llmtower.kernels.ops import kernel_library
from llmtower.kernels.paged_attention import (DTYPES, check_layout, check_query_start,
                                              check_tables, paged_decode, paged_decode_mq,
                                              raise_for_code)

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@functools.cache
def _fn() -> Callable[..., int]:
    f = kernel_library().paged_decode_int8
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64, _I64,
                  ctypes.c_float, ctypes.c_int, ctypes.c_int, _I64]
    return f


def paged_decode_int8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                      scale: float, num_threads: int, tables_checked: bool = False,
                      query_start: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """``paged_decode`` over int8 caches [num_blocks, block_size, Hkv, D + 4 * groups]
    (values, then each group's float32 scale; ``kernels/kv_quant.py``). q [T, H, D] and out
    [T, H, D] float32 or bfloat16 (one dtype). ``query_start`` None: one row per request;
    else [n + 1] offsets of each request's rows (``paged_decode_mq``'s contract). ``window``
    > 0: a row at position p sees keys > p - window. ``tables_checked``: tables, lengths and starts already checked for this cache."""
    t, h, d = q.shape
    nb, bs, hkv, w = k_cache.shape
    if w != row_width(d, torch.int8) or h % hkv or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_int8: q {tuple(q.shape)} does not fit the int8 cache "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if k_cache.dtype != torch.int8 or v_cache.dtype != torch.int8:
        raise TypeError("paged_decode_int8: the caches must be int8")
    if q.dtype not in DTYPES or out.dtype != q.dtype:
        raise TypeError(f"paged_decode_int8: q and out must share float32 or bfloat16, got "
                        f"{q.dtype} and {out.dtype}")
    n = t if query_start is None else (context_lens.shape[0] if context_lens.dim() == 1 else -1)
    check_layout("paged_decode_int8", q, k_cache, v_cache, out, block_tables, context_lens,
                 h, d, num_reqs=n)
    if n == 0 and t == 0:
        return out
    if not tables_checked:
        if query_start is not None:
            check_query_start("paged_decode_int8", query_start, context_lens, t)
        check_tables(block_tables, context_lens, nb, bs)
    starts = None if query_start is None else query_start.data_ptr()
    rc = _fn()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
               block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
               starts, out.data_ptr(), n, h, hkv, d, bs, group_size(d), scale,
               DTYPES[q.dtype], num_threads, max(0, window))
    raise_for_code("paged_decode_int8", rc)
    return out


def paged_decode_kv(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                    context_lens: torch.Tensor, out: torch.Tensor, scale: float,
                    query_start: torch.Tensor | None = None, window: int = 0) -> torch.Tensor:
    """Decode attention for one layer's cache [2, blocks, bs, Hkv, W] whose dtype differs from
    q's; tables (and ``query_start``, for several rows per request) already checked
    (``PagedAttention.forward`` does once per step). ``window`` > 0: a sliding window."""
    threads = torch.get_num_threads()
    if kv_cache.dtype == torch.int8:
        return paged_decode_int8(q, kv_cache[0], kv_cache[1], block_tables, context_lens, out,
                                 scale, threads, tables_checked=True, query_start=query_start,
                                 window=window)
    # A narrower float cache (bfloat16 under a float32 model): q in the cache's dtype for the
    # float kernel; q and out are a few rows, the cache is read in place.
    o = torch.empty(out.shape, dtype=kv_cache.dtype)
    if query_start is None:
        paged_decode(q.to(kv_cache.dtype), kv_cache[0], kv_cache[1], block_tables, context_lens,
                     o, scale, threads, tables_checked=True, window=window)
    else:
        paged_decode_mq(q.to(kv_cache.dtype), kv_cache[0], kv_cache[1], block_tables,
                        context_lens, query_start, o, scale, threads, checked=True,
                        window=window)
    return out.copy_(o)
