"""PagedAttention's per-layer options (sliding window, logit soft-cap, attention sinks, scale)
on every kind of work in a step (one-row decodes, decodes with drafts, a fresh prefill, a
prefill after a cached context), on both backends, against a dense float64 reference written
from the definitions (transformers' semantics: a query at position p sees keys > p - window)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from llmtower.kernels.kv_quant import quantize
from llmtower.models.attention import (AttentionMetadata, PagedAttention, decode_batch,
                                       decode_groups, kernel_decode_mask)

from tests.models.attention_plans import add_prefills

BS = 4
H, HKV, D = 6, 2, 16
# (new tokens, cached before them): a decode, decodes with drafts, fresh prefills longer and
# shorter than the windows, a chunk after a context, decodes deep past every window.
SCHED = [1, 5, 3, 23, 7, 9, 1, 1]
START = [17, 30, 8, 0, 0, 21, 40, 2]


def _setup(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    end = [s + q for s, q in zip(START, SCHED)]
    nbs = [-(-e // BS) for e in end]
    nblocks = sum(nbs) + 3
    perm = torch.randperm(nblocks, generator=g).numpy()
    tables = np.zeros((len(SCHED), max(nbs) + 1), dtype=np.int64)
    used = 0
    for r, nb in enumerate(nbs):
        tables[r, :nb] = perm[used:used + nb]
        used += nb
    # every request's whole K/V sequence and its new queries
    ks = [torch.randn(e, HKV, D, generator=g) for e in end]
    vs = [torch.randn(e, HKV, D, generator=g) for e in end]
    qs = [torch.randn(q, H, D, generator=g) for q in SCHED]
    cache = torch.zeros(2, nblocks, BS, HKV, D)
    for r in range(len(SCHED)):
        pos = np.arange(START[r])
        flat = tables[r, pos // BS] * BS + pos % BS
        cache[0].view(-1, HKV, D)[flat] = ks[r][:START[r]]
        cache[1].view(-1, HKV, D)[flat] = vs[r][:START[r]]
    return tables, ks, vs, qs, cache.to(dtype)


def _plan(tables, backend, dtype):
    sched, start = np.array(SCHED), np.array(START)
    end = start + sched
    dec = kernel_decode_mask(sched, start, backend, dtype)
    d = np.flatnonzero(dec)
    d = d[np.argsort(end[d], kind="stable")]
    order = np.concatenate([d, np.flatnonzero(~dec)])
    pos = np.concatenate([np.arange(start[i], end[i]) for i in order])
    req = np.repeat(order, sched[order])
    meta = AttentionMetadata(int(sched.sum()), torch.from_numpy(tables[req, pos // BS] * BS
                                                                + pos % BS))
    if backend == "c":
        meta.decodes = decode_batch(tables[d], end[d], BS, sched[d])
    else:
        meta.decode_groups = decode_groups(tables[d], end[d], BS, 64, dtype)
    row = int(sched[d].sum())
    add_prefills(meta, tables, start, end, sched, np.flatnonzero(~dec), row, BS)
    return meta, order


def _reference(q, k, v, start, scale, window, softcap, sinks):
    """One request's new rows, dense, float64."""
    g = H // HKV
    k = k.double().repeat_interleave(g, dim=1).transpose(0, 1)  # [H, L, D]
    v = v.double().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(q.double().transpose(0, 1), k.transpose(1, 2)) * scale  # [H, n, L]
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    pos = torch.arange(start, start + q.shape[0])[:, None]
    keys = torch.arange(k.shape[1])[None, :]
    seen = keys <= pos
    if window is not None:
        seen &= keys > pos - window
    s = s.masked_fill(~seen, -torch.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(H, 1, 1).expand(H, s.shape[1], 1)], dim=-1)
    p = torch.softmax(s, dim=-1)[..., :k.shape[1]]
    return torch.matmul(p, v).transpose(0, 1).reshape(q.shape[0], H * D)


OPTIONS = {
    "plain": {},
    "window5": dict(sliding_window=5),
    "window8": dict(sliding_window=8),
    "window1": dict(sliding_window=1),
    "softcap": dict(logit_softcap=3.0),
    "sinks_window": dict(sinks=torch.linspace(-1.0, 2.0, H), sliding_window=6),
    "all": dict(sinks=torch.linspace(0.5, -0.5, H), logit_softcap=2.0, sliding_window=7,
                scale=0.4),
}


@pytest.mark.parametrize("backend", ["c", "torch"])
@pytest.mark.parametrize("name", list(OPTIONS))
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.float32, torch.int8)])
def test_options_match_the_definition(backend, name, dtype, cache_dtype):
    opts = OPTIONS[name]
    tables, ks, vs, qs, cache = _setup(dtype)
    if cache_dtype is torch.int8:
        cache = quantize(cache.float())
    meta, order = _plan(tables, backend, dtype)
    q = torch.cat([qs[i] for i in order]).to(dtype)
    k = torch.cat([ks[i][START[i]:] for i in order]).to(dtype)
    v = torch.cat([vs[i][START[i]:] for i in order]).to(dtype)
    attn = PagedAttention(H, HKV, D, BS, dtype, 64, backend)
    out = attn.forward(q, k, v, cache, meta, **opts).double()
    scale = opts.get("scale", D ** -0.5)
    row = 0
    tol = 1e-5 if dtype == torch.float32 and cache_dtype is None else 4e-2
    for i in order:
        n = SCHED[i]
        want = _reference(qs[i].to(dtype), ks[i].to(dtype), vs[i].to(dtype), START[i], scale,
                          opts.get("sliding_window"), opts.get("logit_softcap"),
                          opts.get("sinks"))
        torch.testing.assert_close(out[row:row + n], want, rtol=tol, atol=tol,
                                   msg=f"request {i} ({name}, {backend})")
        row += n


@pytest.mark.parametrize("backend", ["c", "torch"])
def test_blocks_before_the_window_do_not_count(backend):
    """Blocks wholly before every window may be handed to other requests (the sliding-window
    KV manager frees them): what they then hold changes nothing. The C plan never reads them
    (NaN there stays out); the torch backend's padded decode groups read and mask them, as
    they do the padding (another request's finite values)."""
    tables, ks, vs, qs, cache = _setup(torch.float32)
    outs = []
    for poison in (False, True):
        c = cache.clone()
        if poison:
            for r in range(len(SCHED)):
                first_seen = max(0, START[r] - 5 + 1)  # window 5: the first row's first key
                for b in range(first_seen // BS):
                    c[:, tables[r, b]] = torch.nan if backend == "c" else 1e3
        meta, order = _plan(tables, backend, torch.float32)
        q = torch.cat([qs[i] for i in order])
        k = torch.cat([ks[i][START[i]:] for i in order])
        v = torch.cat([vs[i][START[i]:] for i in order])
        attn = PagedAttention(H, HKV, D, BS, torch.float32, 64, backend)
        outs.append(attn.forward(q, k, v, c, meta, sliding_window=5))
    torch.testing.assert_close(outs[1], outs[0])
