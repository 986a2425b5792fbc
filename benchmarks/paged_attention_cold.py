"""Decode attention as the engine meets it: every layer's cache cold, per layer call.

``paged_attention_kernel.py`` times one layer's cache over and over, which then sits in the
L3 cache (10 MB at SmolLM2's shape in bfloat16); in the engine each layer's K/V is evicted by
the other 29 layers and the weights between two reads. Here 64 decoding requests (contexts
uniform in 32-384 tokens, as in the 64-prompt throughput run: 32-256 prompt + up to 128 output)
attend to 30 layers' caches in turn, blocks scattered at random as after the interleaved
block allocation of a batch, SmolLM2's shape (9 heads, 3 KV heads, head dim 64, block 16).
Prints ms per layer call (median of the rounds; with ``--threads 1`` CPU time of the thread), the KV bytes read per call, the rate that
implies, and the rate of a plain streaming read (``torch.sum`` over the same caches) as the
memory floor; ``--tiny`` also times contexts of one token (the per-call fixed cost).

    chrt -f 1 .venv/bin/python benchmarks/paged_attention_cold.py --threads 2
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from llmtower.kernels.paged_attention import paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK, REQS = 9, 3, 64, 16, 64
LAYERS = 30  # --warm: 1, whose cache then stays in L3


def setup(dtype: torch.dtype, lo: int, hi: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ctx = rng.integers(lo, hi + 1, REQS).astype(np.int64)
    nbs = -(-ctx // BLOCK)
    num_blocks = int(nbs.sum()) + 8
    ids = rng.permutation(num_blocks)
    table = np.zeros((REQS, int(nbs.max())), dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(nbs)])
    for r in range(REQS):
        table[r, :nbs[r]] = ids[starts[r]:starts[r + 1]]
    caches = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    q = torch.randn(REQS, HEADS, HEAD_DIM).to(dtype)
    return torch.from_numpy(ctx), torch.from_numpy(table), caches, q


def time_calls(dtype: torch.dtype, threads: int, rounds: int, lo: int, hi: int) -> tuple[float, float]:
    """(median ms per layer call, KV bytes read per call)"""
    ctx, table, caches, q = setup(dtype, lo, hi)
    out = torch.empty_like(q)
    scale = HEAD_DIM ** -0.5
    # one thread: this thread's CPU time, which a busy machine's other jobs do not inflate
    clock = time.thread_time if threads == 1 else time.perf_counter
    per = []
    for i in range(rounds + 1):
        t0 = clock()
        for c in caches:
            paged_decode(q, c[0], c[1], table, ctx, out, scale, threads, tables_checked=True)
        if i:  # the first round warms the code and the page tables
            per.append((clock() - t0) / LAYERS * 1e3)
    kv_bytes = int(ctx.sum()) * 2 * KV_HEADS * HEAD_DIM * q.element_size()
    return statistics.median(per), kv_bytes


def stream_rate(rounds: int) -> float:
    """GB/s of torch.sum over 30 float32 caches, the memory floor (a bfloat16 sum runs slower
    than memory, in its conversion)."""
    _, _, caches, _ = setup(torch.float32, 32, 384)
    total = sum(c.numel() * c.element_size() for c in caches)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in caches:
            c.sum(dtype=torch.float32)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--tiny", action="store_true", help="also contexts of 1 token (fixed cost)")
    p.add_argument("--warm", action="store_true",
                   help="one layer's cache, read again and again (in L3): the compute side")
    p.add_argument("--stream", action="store_true", help="also the torch.sum streaming rate")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.warm:
        global LAYERS
        LAYERS = 1
    print(f"ms per layer call, 64 decodes of 32-384 tokens, {LAYERS} layers' caches, SmolLM2 shape, "
          f"{args.threads} threads")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        ms, kv = time_calls(dtype, args.threads, args.rounds, 32, 384)
        line = f"{name:9} {ms:7.3f} ms  {kv / 1e6:6.2f} MB/call  {kv / ms / 1e6:5.1f} GB/s"
        if args.tiny:
            line += f"  | 1-token contexts {time_calls(dtype, args.threads, args.rounds, 1, 1)[0]:.3f} ms"
        if args.stream:
            line += f"  | torch.sum {stream_rate(5):5.1f} GB/s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
