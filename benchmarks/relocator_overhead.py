"""What the block relocator costs the scheduler: the time of measuring fragmentation, of
planning one step's moves (a copy budget of 64), and of a full defragmentation, on pools of
the sizes a real engine has (SmolLM2-135M in float32: 1 GiB of KV = 1,365 blocks of 16
tokens), after churn that leaves requests' block tables and the free space scattered.

    .venv/bin/python benchmarks/relocator_overhead.py
"""
from __future__ import annotations

import os
import random
import time

from llmtower.core.config import CacheConfig
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.kv_cache.relocator import BlockRelocator, layout_fragmentation
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams


def churned(num_blocks: int, seed: int = 0) -> KVCacheManager:
    """Requests of 1-40 blocks admitted and a third of them freed, until the pool is ~70% used."""
    kv = KVCacheManager(CacheConfig(block_size=16, num_blocks=num_blocks))
    rng = random.Random(seed)
    live: list[Request] = []
    n = 0
    while kv.pool.num_free_blocks > 0.3 * num_blocks:
        n += 1
        req = Request(f"r{n}", [rng.randrange(1, 30000) for _ in range(16 * rng.randint(1, 40))],
                      SamplingParams(max_tokens=1))
        if kv.allocate_slots(req, req.num_tokens) is None:
            break
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req, req.num_tokens)
        live.append(req)
        if rng.random() < 0.33:
            kv.free(live.pop(rng.randrange(len(live))))
    return kv


def best_of(fn, rounds: int = 5) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    print(f"load avg {os.getloadavg()[0]:.1f}; ms, best of 5")
    print(f"{'blocks':>7} {'frag':>5} {'measure':>8} {'plan 64':>8} {'full defrag':>12} {'moves':>6}")
    for num_blocks in (512, 1365, 4096, 16384):
        kv = churned(num_blocks)
        tables = kv.block_tables()
        frag = layout_fragmentation(kv.pool, tables)
        measure = best_of(lambda kv=kv, tables=tables: layout_fragmentation(kv.pool, tables))
        # Planning applies its moves: time it on a fresh copy of the same churned pool.
        kv1 = churned(num_blocks)
        rel1 = BlockRelocator(kv1.pool, 0.0, 64)
        t0 = time.perf_counter()
        rel1.plan_step(kv1.block_tables(), set())
        plan = (time.perf_counter() - t0) * 1e3
        kv2 = churned(num_blocks)
        rel = BlockRelocator(kv2.pool, 0.0, 64)
        t0 = time.perf_counter()
        moves, _ = rel.defragment(kv2.block_tables())
        full = (time.perf_counter() - t0) * 1e3
        print(f"{num_blocks:7d} {frag:5.2f} {measure:8.2f} {plan:8.2f} {full:12.2f} {len(moves):6d}")


if __name__ == "__main__":
    main()
