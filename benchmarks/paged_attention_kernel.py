"""Decode attention alone: the C kernel against the PyTorch path (gather + SDPA), per layer step.

64 decoding requests with contexts uniform in 96-320 tokens (W1's decode phase), block size 16,
on the model shapes of W1 (12 heads, 12 KV heads) and SmolLM2 (9 heads, 3 KV heads), with each
request's blocks consecutive (a fresh pool) or scattered at random (a pool after churn), in
float32 and bfloat16. Both backends run through ``PagedAttention.forward`` with the metadata the
model runner would build; the best of 5 rounds of 20 calls is printed.

Multi-query rows (``--multi-query``): 8 requests (96-320 tokens of context) each verifying
q_len new tokens (its last token + drafts), SmolLM2's shape: the multi-query kernel
(``paged_decode_mq``, one call for all) against the path such requests took before it (one
"prefill with context" per request: gather its blocks, SDPA with an offset causal mask). The
crossover sets ``MAX_DECODE_QUERY_ROWS``.

    .venv/bin/python benchmarks/paged_attention_kernel.py [--threads 2] [--multi-query]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from llmtower.executor.model_runner import DECODE_GROUP_BYTES
from llmtower.models.attention import (AttentionMetadata, PagedAttention, PrefillSeq,
                                       decode_batch, decode_groups)

SHAPES = {"W1": (12, 12, 64), "SmolLM2": (9, 3, 64)}
BLOCK = 16


def metadata(backend: str, ctx: np.ndarray, table: np.ndarray, kv_heads: int, head_dim: int,
             dtype: torch.dtype) -> AttentionMetadata:
    """What the model runner plans for these decodes (ctx ascending)."""
    meta = AttentionMetadata(len(ctx), torch.zeros(0, dtype=torch.long))
    if backend == "c":
        meta.decodes = decode_batch(table, ctx, BLOCK)
    else:
        budget = max(BLOCK, DECODE_GROUP_BYTES // (2 * kv_heads * head_dim * dtype.itemsize))
        meta.decode_groups = decode_groups(table, ctx, BLOCK, budget, dtype)
    return meta


def time_layer(backend: str, heads: int, kv_heads: int, head_dim: int, scattered: bool,
               dtype: torch.dtype) -> float:
    rng = np.random.default_rng(0)
    ctx = np.sort(rng.integers(96, 321, 64)).astype(np.int64)
    need = int((-(-ctx // BLOCK)).sum())
    num_blocks = need + 64
    ids = rng.permutation(num_blocks) if scattered else np.arange(num_blocks)
    table = np.zeros((64, 2048 // BLOCK), dtype=np.int64)
    used = 0
    for r, c in enumerate(ctx):
        nb = -(-int(c) // BLOCK)
        table[r, :nb] = ids[used:used + nb]
        used += nb
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim).to(dtype)
    qkv = torch.randn(64, heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    attn = PagedAttention(heads, kv_heads, head_dim, BLOCK, dtype, 2048, backend)
    meta = metadata(backend, ctx, table, kv_heads, head_dim, dtype)
    # The decodes' own new K/V go to slots past every context (the runner writes them first).
    meta.slot_mapping = torch.arange(64) + (num_blocks - 64) * BLOCK
    attn.forward(q, k, v, cache, meta)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            attn.forward(q, k, v, cache, meta)
        best = min(best, (time.perf_counter() - t0) / 20)
    return best * 1e3


def time_multi_query(q_len: int, dtype: torch.dtype, num_reqs: int = 8) -> tuple[float, float]:
    """CPU ms (all threads) per layer step for ``num_reqs`` requests with q_len new rows each:
    (multi-query kernel, per-request prefill-with-context path)."""
    heads, kv_heads, head_dim = SHAPES["SmolLM2"]
    rng = np.random.default_rng(1)
    ctx = np.sort(rng.integers(96, 321, num_reqs)).astype(np.int64) + q_len
    nbs = -(-ctx // BLOCK)
    num_blocks = int(nbs.sum()) + 8
    ids = rng.permutation(num_blocks)
    table = np.zeros((num_reqs, 2048 // BLOCK), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(nbs)])
    for r in range(num_reqs):
        table[r, :nbs[r]] = ids[starts[r]:starts[r + 1]]
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, head_dim).to(dtype)
    t = num_reqs * q_len
    qkv = torch.randn(t, heads + 2 * kv_heads, head_dim).to(dtype)
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    # each request's new rows are the last q_len positions of its context
    pos = np.concatenate([np.arange(c - q_len, c) for c in ctx])
    req = np.repeat(np.arange(num_reqs), q_len)
    slots = torch.from_numpy(table[req, pos // BLOCK] * BLOCK + pos % BLOCK)
    attn = PagedAttention(heads, kv_heads, head_dim, BLOCK, dtype, 2048, "c")
    mq = AttentionMetadata(t, slots)
    mq.decodes = decode_batch(table, ctx, BLOCK, np.full(num_reqs, q_len))
    old = AttentionMetadata(t, slots)
    for r in range(num_reqs):
        c, s = int(ctx[r]), int(ctx[r]) - q_len
        old.prefills.append(PrefillSeq(
            r * q_len, q_len, s, torch.from_numpy(table[r, :nbs[r]].copy()),
            torch.from_numpy(np.arange(c)[None, :] <= (s + np.arange(q_len))[:, None])))
    if q_len == 1:  # the one-query kernel's plan, as the runner builds it for plain decodes
        old = AttentionMetadata(t, slots)
        old.decodes = decode_batch(table, ctx, BLOCK)
    times = []
    for meta in (mq, old):
        attn.forward(q, k, v, cache, meta)
        best = float("inf")
        for _ in range(5):  # CPU time of the process: on a shared machine wall time is noise
            t0 = time.process_time()
            for _ in range(20):
                attn.forward(q, k, v, cache, meta)
            best = min(best, (time.process_time() - t0) / 20)
        times.append(best * 1e3)
    return times[0], times[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--multi-query", action="store_true",
                   help="only the multi-query table (decodes with drafts)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.multi_query:
        print(f"CPU ms per layer step, 8 requests (96-320 tokens + q_len), SmolLM2 shape, "
              f"{args.threads} threads; 'before': q_len 1 the one-query kernel, else one "
              "gather + SDPA per request")
        print(f"{'dtype':9} {'q_len':>5} {'mq kernel':>10} {'before':>9} {'before / mq':>12}")
        for dtype in (torch.float32, torch.bfloat16):
            for q_len in (1, 2, 5, 9, 16, 24, 32):
                a, b = time_multi_query(q_len, dtype)
                print(f"{str(dtype)[6:]:9} {q_len:5} {a:10.3f} {b:9.3f} {b / a:11.2f}x",
                      flush=True)
        return
    print(f"ms per layer step, 64 decodes of 96-320 tokens, {args.threads} threads")
    print(f"{'shape':8} {'dtype':9} {'blocks':10} {'c kernel':>9} {'torch':>9} {'torch / c':>10}")
    for name, (h, hkv, d) in SHAPES.items():
        for dtype in (torch.float32, torch.bfloat16):
            for scattered in (False, True):
                c = time_layer("c", h, hkv, d, scattered, dtype)
                t = time_layer("torch", h, hkv, d, scattered, dtype)
                print(f"{name:8} {str(dtype)[6:]:9} {'scattered' if scattered else 'in order':10} "
                      f"{c:9.2f} {t:9.2f} {t / c:9.1f}x", flush=True)


if __name__ == "__main__":
    main()
