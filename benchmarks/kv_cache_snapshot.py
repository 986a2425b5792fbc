"""Cost of the KV-cache snapshot behind `GET /v1/admin/kv_cache` and `llmtower diag memory`
on a 100k-block cache, and of the fragmentation figure added to every stats snapshot.

Fills a real Scheduler (fake model, block size 16) with requests until ~90% of the blocks are
in use, aborts every third request so the free list and block tables are scattered and
hashed blocks stay cached, then prints median / p99 over ``--repeats`` of:
  - take_kv_cache_snapshot()      (runs on the engine's busy loop, between two steps)
  - msgpack encode + decode       (engine process -> API process)
  - JSON encode                   (API process -> client) and the answer's size
  - get_stats() and external_fragmentation() (every stats snapshot, ~2 per second)

    python benchmarks/kv_cache_snapshot.py [--num-blocks 100000] [--repeats 30]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import msgspec

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.kv_cache.fragmentation import external_fragmentation
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot, take_kv_cache_snapshot
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor


def fill(num_blocks: int, block_size: int = 16, prompt_len: int = 700) -> EngineCore:
    blocks_per_req = -(-prompt_len // block_size)
    num_reqs = int(num_blocks * 0.9) // blocks_per_req
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=num_reqs + 1, max_num_batched_tokens=num_reqs * prompt_len,
                        max_model_len=prompt_len + 64),
        CacheConfig(block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=0,
                    enable_prefix_caching=True))
    engine = EngineCore(sched, FakeExecutor(num_blocks, block_size, 0, 32000))
    for i in range(num_reqs):
        # Requests in groups of 4 share their first 256 tokens (prefix-cache hits, shared blocks).
        shared = [1 + (i // 4) % 30000] * 256
        prompt = shared + [(i * 7 + k) % 31999 + 1 for k in range(prompt_len - 256)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=32, ignore_eos=True),
                                  eos_token_id=0))
    engine.step()  # prefill everyone
    engine.step()  # a decode: the full blocks are now in the prefix cache
    sched.abort_requests([f"r{i}" for i in range(0, num_reqs, 3)])
    return engine


def timed(fn, repeats: int) -> tuple[float, float, float]:
    """Median wall ms, p99 wall ms and median CPU ms of this process (CPU time is what the
    busy loop gives up; wall time also counts the neighbours of a shared machine)."""
    wall, cpu = [], []
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        cpu.append((time.process_time() - c0) * 1e3)
        wall.append((time.perf_counter() - t0) * 1e3)
    wall.sort()
    return statistics.median(wall), wall[min(len(wall) - 1, int(0.99 * len(wall)))], \
        statistics.median(cpu)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-blocks", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    t0 = time.perf_counter()
    engine = fill(args.num_blocks)
    sched = engine.scheduler
    print(f"filled {args.num_blocks} blocks in {time.perf_counter() - t0:.1f} s; "
          f"load average {os.getloadavg()[0]:.2f}")
    snap = take_kv_cache_snapshot(sched)
    print(f"running requests {len(snap.requests)}, blocks: {snap.counts()}, "
          f"free runs {snap.fragmentation.num_free_runs}, "
          f"external fragmentation {snap.fragmentation.external:.3f}")
    packed = msgspec.msgpack.encode(snap)
    as_json = msgspec.json.encode({"engines": [snap]})
    rows = [
        ("take_kv_cache_snapshot", lambda: take_kv_cache_snapshot(sched)),
        ("msgpack encode + decode", lambda: msgspec.msgpack.decode(
            msgspec.msgpack.encode(snap), type=KVCacheSnapshot)),
        ("JSON encode", lambda: msgspec.json.encode({"engines": [snap]})),
        ("get_stats (whole stats snapshot)", sched.get_stats),
        ("external_fragmentation", lambda: external_fragmentation(sched.kv.pool)),
    ]
    print(f"{'':34s} {'wall median ms':>15s} {'wall p99 ms':>12s} {'CPU median ms':>14s}")
    for name, fn in rows:
        med, p99, cpu = timed(fn, args.repeats)
        print(f"{name:34s} {med:15.3f} {p99:12.3f} {cpu:14.3f}")
    print(f"sizes: msgpack {len(packed) / 1e3:.0f} kB, JSON {len(as_json) / 1e3:.0f} kB; "
          f"load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
