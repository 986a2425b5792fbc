"""Python side of the C paged decode-attention kernel (``paged_attention.c``).

``paged_decode(...)`` checks shapes, dtypes and layouts (a wrong pointer in C is a crash, not
an exception, so everything the C code assumes is checked here) and calls the kernel with the
tensors' data pointers; ctypes releases the GIL for the call.
"""
from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from llmtower.kernels.ops import kernel_library

_P, _I64 = ctypes.c_void_p, ctypes.c_int64
DTYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's dtype codes


@functools.cache
def _fn() -> Callable[..., int]:
    f = kernel_library().paged_decode
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                  ctypes.c_float, ctypes.c_int, ctypes.c_int]
    return f


@functools.cache
def _fn_window() -> Callable[..., int]:
    """paged_decode with a window (``_fn``'s signature plus it: decode_layer.c calls that one
    by address)."""
    f = kernel_library().paged_decode_window
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _I64, _I64, _I64, _I64, _I64,
                  ctypes.c_float, ctypes.c_int, ctypes.c_int, _I64]
    return f


@functools.cache
def _fn_mq() -> Callable[..., int]:
    f = kernel_library().paged_decode_mq_window
    f.restype = ctypes.c_int
    f.argtypes = [_P, _I64, _P, _P, _P, _I64, _P, _P, _P, _I64, _I64, _I64, _I64, _I64,
                  ctypes.c_float, ctypes.c_int, ctypes.c_int, _I64]
    return f


def raise_for_code(fn: str, rc: int, memory: str = "its scratch buffers") -> None:
    """The error an attention kernel's return code means (0: none): -1 it could not allocate
    ``memory``, anything else it refused its inputs."""
    if rc == -1:
        raise MemoryError(f"{fn}: the kernel could not allocate {memory}")
    if rc != 0:
        raise RuntimeError(f"{fn}: the kernel refused its inputs (code {rc})")


def _check_operands(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Shapes and dtypes both decode kernels need before any pointer reaches C."""
    h, d = q.shape[1], q.shape[2]
    hkv, d2 = k_cache.shape[2], k_cache.shape[3]
    if d2 != d or h % hkv or v_cache.shape != k_cache.shape:
        raise ValueError(f"{fn}: q {tuple(q.shape)} does not fit the cache "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"{fn}: q is {q.dtype}; the kernel runs float32 or bfloat16")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if x.dtype != q.dtype:
            raise TypeError(f"{fn}: {name} is {x.dtype} but q is {q.dtype}: one dtype for all")


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, context_lens: torch.Tensor, out: torch.Tensor,
                 scale: float, num_threads: int, tables_checked: bool = False,
                 window: int = 0) -> torch.Tensor:
    """One query token per request against its paged context (``window`` > 0: a query at
    position p sees keys > p - window; blocks wholly before are not read).

    q [n, H, D] (rows may be strided, heads and dims contiguous); k_cache/v_cache
    [num_blocks, block_size, Hkv, D] contiguous; block_tables [n, >= max blocks] int64
    contiguous; context_lens [n] int64 >= 1; out [n, H, D] contiguous. All of q, the caches
    and out float32, or all bfloat16. ``tables_checked``: the caller already passed these
    tables and lengths through ``check_tables`` for a cache of this many blocks.
    """
    n, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    _check_operands("paged_decode", q, k_cache, v_cache, out)
    check_layout("paged_decode", q, k_cache, v_cache, out, block_tables, context_lens, h, d)
    if n == 0:
        return out
    if not tables_checked:
        check_tables(block_tables, context_lens, nb, bs)
    args = (q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
            out.data_ptr(), n, h, hkv, d, bs, scale, DTYPES[q.dtype], num_threads)
    rc = _fn_window()(*args, max(0, window)) if window > 0 else _fn()(*args)
    raise_for_code("paged_decode", rc, "its score buffer")
    return out


def paged_decode_mq(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start: torch.Tensor, out: torch.Tensor, scale: float, num_threads: int,
                    checked: bool = False, window: int = 0) -> torch.Tensor:
    """Several query rows per request against its paged context, causal among them.

    Request r owns the rows ``query_start[r]:query_start[r + 1]`` (at least one) of q [T, H, D]
    and out [T, H, D]: its newest tokens, whose K/V are already in the cache; its last row sits
    at position ``context_lens[r] - 1`` and row i sees the keys up to its own position. Layouts
    and dtypes as ``paged_decode``; query_start [n + 1] int64 contiguous from 0 to T.
    ``checked``: the caller already passed these tables, lengths and starts through
    ``check_tables`` and ``check_query_start`` for a cache of this many blocks. ``window`` > 0:
    a row at position p sees keys > p - window.
    """
    t, h, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    _check_operands("paged_decode_mq", q, k_cache, v_cache, out)
    n = context_lens.shape[0] if context_lens.dim() == 1 else -1
    check_layout("paged_decode_mq", q, k_cache, v_cache, out, block_tables, context_lens, h, d,
                 num_reqs=n)
    if n == 0 and t == 0:
        return out
    if not checked:
        check_query_start("paged_decode_mq", query_start, context_lens, t)
        check_tables(block_tables, context_lens, nb, bs)
    rc = _fn_mq()(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                  block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(),
                  query_start.data_ptr(), out.data_ptr(), n, h, hkv, d, bs, scale,
                  DTYPES[q.dtype], num_threads, max(0, window))
    raise_for_code("paged_decode_mq", rc)
    return out


def check_query_start(fn: str, query_start: torch.Tensor, context_lens: torch.Tensor,
                      num_rows: int) -> None:
    """Every request's rows ``query_start[r]:query_start[r + 1]`` inside the ``num_rows`` rows
    of q and out, at least one each, and no more than its context holds: C reads q and writes
    out through these offsets."""
    n = context_lens.shape[0]
    if (query_start.dtype != torch.int64 or not query_start.is_contiguous()
            or query_start.shape != (n + 1,)):
        raise ValueError(f"{fn}: query_start must be contiguous int64 of shape ({n + 1},)")
    q_lens = query_start[1:] - query_start[:-1]
    if int(query_start[0]) != 0 or int(query_start[-1]) != num_rows:
        raise ValueError(f"{fn}: query_start must run from 0 to the {num_rows} query rows")
    if n and (int(q_lens.min()) < 1 or bool((q_lens > context_lens).any())):
        raise ValueError(f"{fn}: every request needs 1..context_len query rows")


def check_tables(block_tables: torch.Tensor, context_lens: torch.Tensor, num_blocks: int,
                 block_size: int) -> None:
    """The C code trusts every block id and length: one bad index would read outside the
    cache. Every length in 1..(table width * block_size), every block it covers in the cache."""
    max_len = int(context_lens.max())
    if int(context_lens.min()) < 1 or max_len > block_tables.shape[1] * block_size:
        raise ValueError("paged_decode: context lengths must be in "
                         f"1..{block_tables.shape[1] * block_size}")
    used = block_tables[:, :-(-max_len // block_size)]
    if int(used.min()) < 0 or int(used.max()) >= num_blocks:
        raise ValueError(f"paged_decode: block ids must be in 0..{num_blocks - 1}")


def check_layout(fn: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 out: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor,
                 h: int, d: int, num_reqs: int | None = None) -> None:
    """The memory layout every decode kernel trusts before it takes a pointer (``fn`` names
    the caller in the error). ``num_reqs``: the requests of a multi-query call (default: one
    per row of q)."""
    n = q.shape[0]
    if q.stride(2) != 1 or q.stride(1) != d:
        raise ValueError(f"{fn}: q's heads and head dims must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous() and out.is_contiguous()):
        raise ValueError(f"{fn}: the caches and the output must be contiguous")
    if tuple(out.shape) != (n, h, d):
        raise ValueError(f"{fn}: out is {tuple(out.shape)}, expected {(n, h, d)}")
    if num_reqs is not None:
        n = num_reqs
    if (block_tables.dtype != torch.int64 or context_lens.dtype != torch.int64
            or not block_tables.is_contiguous() or not context_lens.is_contiguous()
            or block_tables.dim() != 2 or block_tables.shape[0] != n or context_lens.shape != (n,)):
        raise ValueError(f"{fn}: block_tables [n, blocks] and context_lens [n] must be "
                         "contiguous int64")
