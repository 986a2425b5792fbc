"""The KV-cache snapshot behind `llmtower diag memory`: block states, block tables, free runs,
fragmentation and the prefix cache, checked against the scheduler's own bookkeeping."""
from __future__ import annotations

import msgspec
from sched_helpers import make_engine, make_request, run_to_completion

from llmtower.core.kv_cache.block_pool import BlockPool
from llmtower.core.kv_cache.fragmentation import (
    block_runs,
    external_fragmentation,
    free_runs,
)
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot, take_kv_cache_snapshot


def test_block_runs_compress_consecutive_ids():
    assert block_runs([]) == []
    assert block_runs([0, 1, 2, 7, 8, 3]) == [(0, 3), (7, 2), (3, 1)]
    assert block_runs([5]) == [(5, 1)]


def test_free_runs_and_external_fragmentation_follow_the_free_list():
    pool = BlockPool(10, enable_prefix_caching=False)
    assert free_runs(pool) == free_runs(pool)
    assert (free_runs(pool).largest, external_fragmentation(pool)) == (10, 0.0)
    blocks = pool.allocate(10)
    assert free_runs(pool).num_runs == 0 and external_fragmentation(pool) == 0.0
    pool.free([b for b in blocks if b.block_id % 2 == 0])  # 0, 2, 4, 6, 8: none touch
    runs = free_runs(pool)
    assert (runs.num_runs, runs.largest, runs.num_free) == (5, 1, 5)
    assert external_fragmentation(pool) == 1 - 1 / 5
    pool.free([blocks[1], blocks[3]])  # 0..4 is now one run of 5
    assert free_runs(pool).largest == 5 and free_runs(pool).num_runs == 3


def test_snapshot_shows_states_tables_sharing_and_the_prefix_cache():
    engine = make_engine(block_size=4, num_blocks=16)
    sched = engine.scheduler
    prefix = list(range(1, 9))  # two full blocks shared by a and b
    sched.add_request(make_request("done", [30, 31, 32, 33, 34], max_tokens=2))
    run_to_completion(engine)  # its full block stays cached after it finished: state 'c'
    sched.add_request(make_request("a", prefix + [20], max_tokens=50, ignore_eos=True))
    engine.step()
    sched.add_request(make_request("b", prefix + [21, 22], max_tokens=50, ignore_eos=True))
    engine.step()
    snap = take_kv_cache_snapshot(sched, engine_index=3)

    assert snap.engine_index == 3 and len(snap.block_states) == snap.num_blocks == 16
    tables = {r.request_id: r for r in snap.requests}
    assert set(tables) == {"a", "b"}
    for rid, r in tables.items():
        ids = [b for start, n in r.block_runs for b in range(start, start + n)]
        assert ids == sched.kv.get_block_ids(rid)
        assert r.status == "running" and r.num_blocks == len(ids)
        assert r.unused_slots == len(ids) * 4 - r.num_computed_tokens
    shared = set(sched.kv.get_block_ids("a")) & set(sched.kv.get_block_ids("b"))
    assert len(shared) == 2 and snap.shared_ref_counts == {b: 2 for b in shared}
    for b in shared:
        assert snap.block_states[b] == "s"
    for b in set(sched.kv.get_block_ids("a")) ^ set(sched.kv.get_block_ids("b")):
        assert snap.block_states[b] == "u"
    pool = sched.kv.pool
    for block in pool.blocks:
        if block.ref_cnt == 0:
            assert snap.block_states[block.block_id] == ("c" if block.block_hash else ".")
    assert snap.num_cached_free == 1  # the finished request's one full block
    counts = snap.counts()
    assert sum(counts.values()) == 16
    assert counts["shared"] == 2 and counts["free"] + counts["free, cached prefix"] == \
        pool.num_free_blocks
    assert snap.prefix_cache.num_cached_blocks == len(pool.cached)
    assert snap.prefix_cache.hits == 8 and snap.prefix_cache.hit_rate > 0
    frag = snap.fragmentation
    assert frag.unused_slots == sum(r.unused_slots for r in snap.requests)
    assert frag.internal == frag.unused_slots / frag.allocated_slots
    assert frag.largest_free_run == free_runs(pool).largest
    # It crosses the process boundary as msgpack and reaches operators as JSON.
    again = msgspec.msgpack.decode(msgspec.msgpack.encode(snap), type=KVCacheSnapshot)
    assert again == snap
    assert msgspec.json.decode(msgspec.json.encode(snap), type=KVCacheSnapshot) == snap


def test_a_swapped_request_holds_cpu_blocks_in_the_snapshot():
    engine = make_engine(block_size=4, num_blocks=8, num_cpu_blocks=8, preemption_mode="swap",
                         enable_prefix_caching=False)
    sched = engine.scheduler
    for rid in ("x", "y"):
        sched.add_request(make_request(rid, list(range(1, 11)), max_tokens=40, ignore_eos=True))
    for _ in range(200):
        engine.step()
        if sched.swapped:
            break
    assert sched.swapped, "the cache never ran out: the test needs a preemption by swap"
    snap = take_kv_cache_snapshot(sched)
    victim = sched.swapped[0].request_id
    entry = next(r for r in snap.requests if r.request_id == victim)
    assert entry.status == "swapped" and entry.num_blocks == 0
    assert entry.num_cpu_blocks == len(sched.kv.req_to_cpu_blocks[victim])
    assert snap.cpu_block_states.count("w") == entry.num_cpu_blocks
    assert len(snap.cpu_block_states) == 8
