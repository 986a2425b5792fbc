"""Sliding-window decode attention: what a window bounds, as ratios measured in one run.

1. Compute: one decode step's attention (``PagedAttention.forward``, C backend) for 16
   requests with long contexts, Mistral-7B's head shape (32 heads, 8 KV heads, 128 dims) with
   bfloat16 caches, without a window, with a window of 1/8 of the context (the C kernel reads
   only the window's blocks), and the same window on the torch path (request by request: what
   a call the kernels cannot do, here a soft-capped one, costs).
2. Memory: KV blocks a request holds over a long generation on a model whose every layer is
   windowed (the scheduler over the fake executor), against the same run without a window.

    .venv/bin/python benchmarks/sliding_window.py [--context 4096] [--window 512] [--threads 1]
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor
from llmtower.kernels import ops
from llmtower.models.attention import AttentionMetadata, PagedAttention, decode_batch

H, HKV, D, BS, REQS = 32, 8, 128, 16, 16


def _best(fn, rounds: int = 5, calls: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls)
    return best


def compute(context: int, window: int) -> None:
    nb = -(-context // BS)
    tables = np.arange(REQS * nb, dtype=np.int64).reshape(REQS, nb)
    cache = torch.randn(2, REQS * nb, BS, HKV, D).to(torch.bfloat16)
    end = np.full(REQS, context, dtype=np.int64)
    q = torch.randn(REQS, H, D).to(torch.bfloat16)
    attn = PagedAttention(H, HKV, D, BS, torch.bfloat16, 64, "c")

    def step(**kw):
        meta = AttentionMetadata(REQS, torch.zeros(REQS, dtype=torch.int64))
        meta.decodes = decode_batch(tables, end, BS)
        return lambda: attn.forward(q, q[:, :HKV], q[:, :HKV], cache, meta, kv_written=True,
                                    **kw)

    full = _best(step())
    windowed = _best(step(sliding_window=window))
    caps = ops.capabilities()
    # A soft-capped call (Gemma 2's): an option the kernel lacks, so the torch path serves it
    # (a cap this large leaves the scores as they are).
    torch_path = _best(step(sliding_window=window, logit_softcap=1e4), rounds=2, calls=1)
    print(f"decode attention, {REQS} requests x {context} tokens, bfloat16, "
          f"{torch.get_num_threads()} thread(s), kernel on: {caps.can_run('paged_attention')}")
    print(f"  no window            {full * 1e3:8.2f} ms")
    print(f"  window {window:<5}  (C)    {windowed * 1e3:8.2f} ms   {full / windowed:5.2f}x faster")
    print(f"  window {window:<5}  (torch){torch_path * 1e3:8.2f} ms   "
          f"{torch_path / windowed:5.2f}x the C kernel's time")


def memory(window: int, length: int) -> None:
    bs = 16

    def run(w: int | None) -> int:
        cache = CacheConfig(block_size=bs, num_blocks=4 * length // bs, sliding_window=w)
        engine = EngineCore(Scheduler(SchedulerConfig(), cache),
                            FakeExecutor(cache.num_blocks, bs, window=w, verify_kv=False))
        engine.add_request(Request("0", list(range(1, 65)), SamplingParams(
            max_tokens=length, ignore_eos=True), eos_token_id=0))
        most = 0
        while engine.has_unfinished_requests():
            engine.step()
            most = max(most, engine.scheduler.kv.num_blocks_of("0"))
        return most

    bounded, unbounded = run(window), run(None)
    print(f"KV blocks held by one request over {length} generated tokens (block {bs}): "
          f"window {window}: {bounded}, no window: {unbounded} ({unbounded / bounded:.1f}x)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    compute(a.context, a.window)
    memory(a.window, 8 * a.window)


if __name__ == "__main__":
    main()
