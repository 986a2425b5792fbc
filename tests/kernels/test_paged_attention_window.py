"""The paged decode kernels' sliding window: a query at position p sees keys > p - window, on
every path (the grouped AVX-512 path, the per-request one for heads without grouping, the
multi-query one for head sizes the grouped path does not take), equal to the torch path's
answer (``models/attention.py``), and blocks wholly before every window are never read."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.kernels import ops
from llmtower.kernels.paged_attention import paged_decode, paged_decode_mq
from llmtower.models.attention import _band

pytestmark = pytest.mark.skipif(not ops.capabilities().can_run("paged_attention"),
                                reason="the C attention kernel is not available")
BS = 4


def _reference(q, kc, vc, table, ctx, nq, window, scale):
    """q [nq, H, D] of one request at positions ctx - nq .. ctx - 1, dense float64 (the
    poisoned keys it masks taken as zeros)."""
    h, hkv = q.shape[1], kc.shape[2]
    kc, vc = kc.nan_to_num(0.0), vc.nan_to_num(0.0)
    k = kc[table].reshape(-1, hkv, kc.shape[3])[:ctx].double().repeat_interleave(h // hkv, 1)
    v = vc[table].reshape(-1, hkv, kc.shape[3])[:ctx].double().repeat_interleave(h // hkv, 1)
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    seen = torch.from_numpy(_band(np.arange(ctx - nq, ctx), 0, ctx, window))
    p = torch.softmax(s.masked_fill(~seen, -torch.inf), dim=-1)
    return torch.einsum("hqk,khd->qhd", p, v)


@pytest.mark.parametrize("shape", [(6, 2, 16), (4, 4, 32), (6, 3, 24)],
                         ids=["grouped", "no_grouping", "hd24"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 9, 64])
def test_windowed_decode_matches_the_definition(shape, dtype, window):
    h, hkv, d = shape
    g = torch.Generator().manual_seed(window)
    ctxs, nqs = [3, 17, 30, 41, 9], [1, 4, 2, 1, 3]
    nb = [-(-c // BS) for c in ctxs]
    total = sum(nb) + 2
    perm = torch.randperm(total, generator=g).numpy()
    tables = np.zeros((len(ctxs), max(nb)), dtype=np.int64)
    used = 0
    for r, n in enumerate(nb):
        tables[r, :n] = perm[used:used + n]
        used += n
    kc = torch.randn(total, BS, hkv, d, generator=g).to(dtype)
    vc = torch.randn(total, BS, hkv, d, generator=g).to(dtype)
    # Poison the blocks before every request's first window: the kernel must not read them.
    for r, (c, nq) in enumerate(zip(ctxs, nqs)):
        for b in range(max(0, c - nq - window + 1) // BS):
            kc[tables[r, b]] = torch.nan
            vc[tables[r, b]] = torch.nan
    scale = d ** -0.5
    lens = torch.tensor(ctxs)
    bt = torch.from_numpy(tables)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    # one row per request
    q1 = torch.randn(len(ctxs), h, d, generator=g).to(dtype)
    out = torch.empty_like(q1)
    paged_decode(q1, kc, vc, bt, lens, out, scale, 1, window=window)
    for r, c in enumerate(ctxs):
        want = _reference(q1[r:r + 1], kc, vc, tables[r, :nb[r]], c, 1, window, scale)
        torch.testing.assert_close(out[r:r + 1].double(), want, rtol=tol, atol=tol)
    # several rows per request
    starts = torch.from_numpy(np.concatenate([[0], np.cumsum(nqs)]).astype(np.int64))
    qm = torch.randn(int(starts[-1]), h, d, generator=g).to(dtype)
    out = torch.empty_like(qm)
    paged_decode_mq(qm, kc, vc, bt, lens, starts, out, scale, 2, window=window)
    for r, (c, nq) in enumerate(zip(ctxs, nqs)):
        rows = slice(int(starts[r]), int(starts[r + 1]))
        want = _reference(qm[rows], kc, vc, tables[r, :nb[r]], c, nq, window, scale)
        torch.testing.assert_close(out[rows].double(), want, rtol=tol, atol=tol)
