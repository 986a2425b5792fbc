"""Decode attention alone: the C kernel against the PyTorch path (gather + SDPA), per layer step.

64 decoding requests with contexts uniform in 96-320 tokens (W1's decode phase), block size 16,
on the model shapes of W1 (12 heads, 12 KV heads) and SmolLM2 (9 heads, 3 KV heads), with each
request's blocks consecutive (a fresh pool) or scattered at random (a pool after churn), in
float32 and bfloat16. Both backends run through ``PagedAttention.forward`` with the metadata the
model runner would build; the best of 5 rounds of 20 calls is printed.

    .venv/bin/python benchmarks/paged_attention_kernel.py [--threads 2]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from llmtower.executor.model_runner import DECODE_GROUP_BYTES
from llmtower.models.attention import AttentionMetadata, PagedAttention, decode_batch, decode_groups

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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
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
