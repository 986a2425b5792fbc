"""A point-in-time picture of one engine's KV cache, for operators (``llmtower diag memory``,
``GET /v1/admin/kv_cache``, ``LLM.kv_cache_snapshot()``).

Every block's state travels as one character so that a 100k-block cache is a 100 kB string:

  ``.`` free            ``c`` free, still holding a cached prefix (reusable until evicted)
  ``u`` in use (one request)   ``s`` shared by several requests (see ``shared_ref_counts``)

CPU swap blocks get their own string: ``.`` free, ``w`` holding a swapped-out request's block.
Block tables travel as (first id, length) runs, which is both compact and the measure of how
scattered they are. Taking a snapshot is O(allocated blocks) in Python plus O(blocks) in C
(see ``benchmarks/kv_cache_snapshot.py`` for its cost on 100k blocks).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sized
from typing import Protocol

import msgspec

from llmtower.core.kv_cache.fragmentation import block_runs, free_runs
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.request import Request

FREE, CACHED, USED, SHARED = ".", "c", "u", "s"
CPU_FREE, CPU_SWAPPED = ".", "w"
BLOCK_STATES = {FREE: "free", CACHED: "free, cached prefix", USED: "in use",
                SHARED: "shared"}
# free_map byte (1 = on the free list) -> state character, before cached/shared are marked.
_FREE_MAP_TO_STATE = bytes.maketrans(b"\x00\x01", (USED + FREE).encode())


class RequestBlocks(msgspec.Struct):
    """One request holding KV blocks: its block table (as runs) and how full it is."""

    request_id: str
    status: str  # "running" or "swapped"
    priority: int
    num_tokens: int
    num_computed_tokens: int
    num_blocks: int
    # Device block table as [first block id, run length] pairs, in table order.
    block_runs: list[tuple[int, int]]
    # Allocated slots holding no computed token (this request's internal fragmentation).
    unused_slots: int
    num_cpu_blocks: int = 0


class PrefixCacheInfo(msgspec.Struct):
    """What the prefix cache holds and how well it serves (tokens for queries and hits)."""

    num_cached_blocks: int
    num_cached_blocks_in_use: int
    num_cached_blocks_free: int
    queries: int
    hits: int
    hit_rate: float
    evictions: int


class FragmentationInfo(msgspec.Struct):
    """Internal (unused slots of allocated blocks) and external (scattered free list and
    block tables) fragmentation."""

    internal: float
    unused_slots: int
    allocated_slots: int
    external: float
    num_free_runs: int
    largest_free_run: int
    mean_free_run: float
    mean_block_table_run: float


class KVCacheSnapshot(msgspec.Struct):
    """Everything ``llmtower diag memory`` shows about one engine's KV cache."""

    engine_index: int
    num_blocks: int
    block_size: int
    block_states: str
    shared_ref_counts: dict[int, int]
    num_free: int
    num_cached_free: int
    num_used: int
    num_shared: int
    num_cpu_blocks: int
    cpu_block_states: str
    requests: list[RequestBlocks]
    fragmentation: FragmentationInfo
    prefix_cache: PrefixCacheInfo
    num_waiting: int
    timestamp: float
    build_seconds: float = 0.0

    def counts(self) -> dict[str, int]:
        """Blocks per state, keyed by the state's name."""
        return {"free": self.num_free, "free, cached prefix": self.num_cached_free,
                "in use": self.num_used, "shared": self.num_shared}


class KVCacheHolders(Protocol):
    """What a snapshot reads of the scheduler (the ``Scheduler`` is one): the KV cache
    manager and its queues. A protocol, so that kv_cache does not import the scheduler above it."""

    @property
    def kv(self) -> KVCacheManager: ...

    @property
    def running(self) -> Iterable[Request]: ...

    @property
    def swapped(self) -> Iterable[Request]: ...

    @property
    def waiting(self) -> Sized: ...


def take_kv_cache_snapshot(scheduler: KVCacheHolders, engine_index: int = 0) -> KVCacheSnapshot:
    """The KV cache of ``scheduler`` now (call it between two steps)."""
    t0 = time.perf_counter()
    kv = scheduler.kv
    pool = kv.pool
    bs = kv.block_size
    states = bytearray(pool.free_queue.free_map.translate(_FREE_MAP_TO_STATE))
    cached_b, shared_b = CACHED.encode()[0], SHARED.encode()[0]
    num_cached_free = num_cached_in_use = 0
    for b in pool.cached.values():
        if b.ref_cnt == 0:
            states[b.block_id] = cached_b
            num_cached_free += 1
        else:
            num_cached_in_use += 1
    shared: dict[int, int] = {}
    requests: list[RequestBlocks] = []
    unused = allocated = 0
    total_table_runs = total_table_blocks = 0
    cpu_states = bytearray(CPU_FREE.encode() * kv.num_cpu_blocks)
    swapped_b = CPU_SWAPPED.encode()[0]
    holders = [(r, "running") for r in scheduler.running]
    holders += [(r, "swapped") for r in scheduler.swapped]
    for req, status in holders:
        rid = req.request_id
        blocks = kv.req_to_blocks.get(rid, ())
        # Comprehensions, not one loop with appends: this is the snapshot's hot part.
        ids = [b.block_id for b in blocks]
        shared.update([(b.block_id, b.ref_cnt) for b in blocks if b.ref_cnt > 1])
        cpu = kv.req_to_cpu_blocks.get(rid, ())
        for c in cpu:
            cpu_states[c] = swapped_b
        runs = block_runs(ids)
        slots = len(ids) * bs
        req_unused = slots - min(req.num_computed_tokens, slots) if ids else 0
        unused += req_unused
        allocated += slots
        total_table_runs += len(runs)
        total_table_blocks += len(ids)
        requests.append(RequestBlocks(
            rid, status, req.priority, req.num_tokens, req.num_computed_tokens, len(ids),
            runs, req_unused, len(cpu)))
    for block_id in shared:
        states[block_id] = shared_b
    fr = free_runs(pool)
    num_free = fr.num_free
    return KVCacheSnapshot(
        engine_index=engine_index,
        num_blocks=pool.num_blocks,
        block_size=bs,
        block_states=states.decode(),
        shared_ref_counts=shared,
        num_free=num_free - num_cached_free,
        num_cached_free=num_cached_free,
        num_used=pool.num_blocks - num_free - len(shared),
        num_shared=len(shared),
        num_cpu_blocks=kv.num_cpu_blocks,
        cpu_block_states=cpu_states.decode(),
        requests=requests,
        fragmentation=FragmentationInfo(
            internal=unused / allocated if allocated else 0.0,
            unused_slots=unused, allocated_slots=allocated,
            external=fr.external_fragmentation, num_free_runs=fr.num_runs,
            largest_free_run=fr.largest, mean_free_run=fr.mean,
            mean_block_table_run=(total_table_blocks / total_table_runs
                                  if total_table_runs else 0.0)),
        prefix_cache=PrefixCacheInfo(
            num_cached_blocks=len(pool.cached), num_cached_blocks_in_use=num_cached_in_use,
            num_cached_blocks_free=num_cached_free, queries=kv.prefix_cache_queries,
            hits=kv.prefix_cache_hits,
            hit_rate=kv.prefix_cache_hits / kv.prefix_cache_queries
            if kv.prefix_cache_queries else 0.0,
            evictions=pool.num_evictions),
        num_waiting=len(scheduler.waiting),
        timestamp=time.time(),
        build_seconds=time.perf_counter() - t0)
