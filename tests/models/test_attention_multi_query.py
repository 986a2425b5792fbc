"""PagedAttention with multi-query decode rows (a decode with its drafts, a short chunk after a
cached context): one C kernel call gives the same outputs as the per-request "prefill with
context" path they took before, beside plain decodes and a fresh prefill in the same step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.kernels.kv_quant import quantize
from llmtower.models.attention import (MAX_DECODE_QUERY_ROWS, AttentionMetadata, PagedAttention,
                                       decode_batch, kernel_decode_mask)

from tests.models.attention_plans import add_prefills

BS = 4
H, HKV, D = 6, 2, 16


def plan(sched, start, tables, multi_query: bool) -> AttentionMetadata:
    """The step's metadata for requests with ``sched`` new tokens after ``start`` cached
    ones; with ``multi_query`` the kernel takes every request with a context (rows first),
    else only the one-token ones (the old plan)."""
    sched, start = np.array(sched), np.array(start)
    end = start + sched
    dec = (start > 0) if multi_query else (sched == 1)
    order = np.concatenate([np.flatnonzero(dec), np.flatnonzero(~dec)])
    pos = np.concatenate([np.arange(start[i], end[i]) for i in order])
    req = np.repeat(order, sched[order])
    slots = torch.from_numpy(tables[req, pos // BS] * BS + pos % BS)
    meta = AttentionMetadata(int(sched.sum()), slots)
    d = np.flatnonzero(dec)
    meta.decodes = decode_batch(tables[d], end[d], BS, sched[d])
    row = int(sched[d].sum())
    add_prefills(meta, tables, start, end, sched, np.flatnonzero(~dec), row, BS)
    return meta, order


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.int8),
                                               (torch.float32, torch.bfloat16)])
def test_multi_query_plan_equals_the_prefill_with_context_path(dtype, cache_dtype):
    g = torch.Generator().manual_seed(0)
    sched = [1, 5, 9, 3, 6, 1]     # a decode, decodes with 4/8/2 drafts, a fresh prefill, ...
    start = [17, 30, 8, 1, 0, 40]
    nbs = [-(-(s + q) // BS) for s, q in zip(start, sched)]
    tables = np.zeros((len(sched), max(nbs) + 1), dtype=np.int64)
    perm = torch.randperm(sum(nbs) + 4, generator=g).numpy()
    used = 0
    for r, nb in enumerate(nbs):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    cache = torch.randn(2, sum(nbs) + 4, BS, HKV, D, generator=g).to(dtype)
    if cache_dtype is torch.int8:
        cache = quantize(cache.float())
    elif cache_dtype is not None:
        cache = cache.to(cache_dtype)
    t = sum(sched)
    q = torch.randn(t, H, D, generator=g).to(dtype)
    k = torch.randn(t, HKV, D, generator=g).to(dtype)
    v = torch.randn(t, HKV, D, generator=g).to(dtype)
    attn = PagedAttention(H, HKV, D, BS, dtype, 64, "c")
    outs = {}
    for mq in (False, True):
        meta, order = plan(sched, start, tables, mq)
        assert (meta.decodes.query_start is not None) == mq
        # the same tokens, laid out in this plan's row order
        rows = np.concatenate([np.arange(sum(sched[:i]), sum(sched[:i + 1])) for i in order])
        c = cache.clone()
        o = attn.forward(q[rows], k[rows], v[rows], c, meta)
        back = torch.empty_like(o)
        back[torch.from_numpy(rows)] = o
        outs[mq] = back.float()
    tol = 1e-5 if dtype == torch.float32 and cache_dtype is None else 2e-2
    torch.testing.assert_close(outs[True], outs[False], rtol=tol, atol=tol)


def test_which_requests_the_kernel_takes():
    sched = np.array([1, 1, 4, 9, 10, 7, 3])
    start = np.array([0, 5, 12, 50, 50, 50, 0])
    got = kernel_decode_mask(sched, start, "c", torch.float32)
    # one token: always; drafts after a context: up to the float32 limit; fresh prefills: never
    assert got.tolist() == [True, True, True, True, False, True, False]
    assert MAX_DECODE_QUERY_ROWS[torch.float32] == 9
    bf = kernel_decode_mask(sched, start, "c", torch.bfloat16)
    assert bf.tolist() == [True, True, True, False, False, False, False]
    assert kernel_decode_mask(sched, start, "torch", torch.float32).tolist() == (sched == 1).tolist()
