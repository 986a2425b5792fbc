"""The block pool and KV cache manager: prefix sharing, LRU order, atomic allocation."""
from __future__ import annotations

from sched_helpers import make_request
from llmtower.core.config import CacheConfig
from llmtower.core.kv_cache.block_hash import extend_block_hashes, hash_block
from llmtower.core.kv_cache.block_pool import BlockPool
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager


def manager(num_blocks=16, block_size=4, num_cpu_blocks=0, prefix=True) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=block_size, num_blocks=num_blocks,
                                      num_cpu_blocks=num_cpu_blocks, enable_prefix_caching=prefix))


def admit(kv: KVCacheManager, req, compute=True):
    """Look up the cache, allocate the rest of the prompt, and mark it computed and cached."""
    hits, num_hit = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit, hits, num_hit)
    if new is not None and compute:
        req.num_computed_tokens = req.num_tokens
        kv.cache_blocks(req, req.num_computed_tokens)
    return hits, num_hit, new


def test_hash_chain_depends_on_parent_tokens_and_salt():
    a = hash_block(None, [1, 2, 3, 4])
    assert a == hash_block(None, [1, 2, 3, 4])
    assert a != hash_block(None, [1, 2, 3, 5])
    assert hash_block(a, [5, 6]) != hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6])
    assert a != hash_block(None, [1, 2, 3, 4], "tenant-a")
    hashes: list[bytes] = []
    extend_block_hashes(hashes, list(range(10)), 4, 10)
    assert len(hashes) == 2  # the partial third block is never hashed
    extend_block_hashes(hashes, list(range(12)), 4, 12)
    assert len(hashes) == 3 and hashes[1] == hash_block(hashes[0], [4, 5, 6, 7])


def test_hashes_extended_in_any_pieces_are_the_chain_of_hash_block():
    """However a request's blocks are hashed (a whole prompt at once, block by block as
    decodes fill them), each hash is hash_block(parent, tokens), salted at the first only."""
    tokens = [(i * 7919) % (1 << 40) for i in range(70)]
    want, parent = [], None
    for i in range(70 // 8):
        parent = hash_block(parent, tokens[8 * i:8 * i + 8], "s" if i == 0 else None)
        want.append(parent)
    for pieces in ([70], [8, 9, 40, 70], [1, 16, 17, 24, 70]):
        hashes: list[bytes] = []
        for n in pieces:
            extend_block_hashes(hashes, tokens, 8, n, "s")
        assert hashes == want


def test_prefix_hits_share_blocks_with_ref_counts():
    kv = manager()
    r1 = make_request("r1", range(1, 11))  # 10 tokens: 2 full blocks + 2 tokens
    admit(kv, r1)
    r2 = make_request("r2", list(range(1, 9)) + [50, 51, 52])
    hits, num_hit, new = admit(kv, r2)
    assert num_hit == 8 and [b.block_id for b in hits] == kv.get_block_ids("r1")[:2]
    assert [b.ref_cnt for b in hits] == [2, 2]
    assert kv.prefix_cache_queries == 21 and kv.prefix_cache_hits == 8
    kv.free(r1)
    assert [b.ref_cnt for b in hits] == [1, 1]
    kv.free(r2)
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.pool.num_free_blocks == 16


def test_fully_cached_prompt_still_recomputes_its_last_token():
    kv = manager()
    admit(kv, make_request("r1", range(1, 9)))  # exactly 2 full blocks
    r2 = make_request("r2", range(1, 9))
    hits, num_hit, new = admit(kv, r2, compute=False)
    assert num_hit == 4 and len(hits) == 1  # the last block holds the last token: recomputed


def test_free_order_is_lru_with_tail_blocks_first():
    kv = manager(num_blocks=6)
    r1 = make_request("r1", range(1, 13))    # 3 full blocks
    admit(kv, r1)
    r2 = make_request("r2", range(100, 112))  # 3 full blocks
    admit(kv, r2)
    ids1, ids2 = kv.get_block_ids("r1"), kv.get_block_ids("r2")
    kv.free(r1)
    kv.free(r2)
    order = [b.block_id for b in kv.pool.free_queue]
    # r1 freed first (least recent) and within a request the tail block goes first.
    assert order == ids1[::-1] + ids2[::-1]
    # Allocating two new blocks evicts r1's tail blocks, so r1's first block still hits.
    r3 = make_request("r3", range(200, 208))
    admit(kv, r3)
    assert kv.pool.num_evictions == 2
    hits, num_hit = kv.get_computed_blocks(make_request("again", range(1, 13)))
    assert num_hit == 4 and hits[0].block_id == ids1[0]


def test_partial_blocks_never_push_cached_blocks_out():
    kv = manager(num_blocks=4)
    r1 = make_request("r1", range(1, 9))  # 2 full cached blocks
    admit(kv, r1)
    kv.free(r1)
    r2 = make_request("r2", [77, 78])  # 1 partial block, unhashed
    admit(kv, r2)
    kv.free(r2)
    # The unhashed block went to the head: the next allocation reuses it, not a cached one.
    r3 = make_request("r3", [90])
    admit(kv, r3)
    assert kv.pool.num_evictions == 0
    assert kv.get_computed_blocks(make_request("q", range(1, 10)))[1] == 8


def test_failed_allocation_changes_nothing():
    kv = manager(num_blocks=4)
    r1 = make_request("r1", range(1, 9))
    admit(kv, r1)
    kv.free(r1)  # its 2 cached blocks are free but hold the prefix
    big = make_request("big", list(range(1, 9)) + list(range(100, 120)))  # needs 7 blocks
    hits, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    before = [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks]
    assert kv.allocate_slots(big, big.num_tokens - num_hit, hits, num_hit) is None
    assert [(b.ref_cnt, b.block_hash) for b in kv.pool.blocks] == before
    assert kv.pool.num_free_blocks == 4 and "big" not in kv.req_to_blocks
    assert kv.prefix_cache_queries == 8  # the failed attempt is not counted


def test_different_cache_salt_misses():
    kv = manager()
    a = make_request("a", range(1, 13))
    a.cache_salt = "tenant-a"
    admit(kv, a)
    b = make_request("b", range(1, 13))
    b.cache_salt = "tenant-b"
    assert kv.get_computed_blocks(b)[1] == 0
    c = make_request("c", range(1, 13))
    c.cache_salt = "tenant-a"
    assert kv.get_computed_blocks(c)[1] == 8


def test_swap_out_and_in_bookkeeping():
    kv = manager(num_blocks=8, num_cpu_blocks=4, prefix=False)
    r = make_request("r", range(1, 11))
    admit(kv, r)
    assert kv.can_swap_out(r)
    out = kv.swap_out(r)
    assert len(out) == 3 and kv.pool.num_free_blocks == 8 and len(kv.free_cpu_blocks) == 1
    assert kv.can_swap_in(r, 1)
    back = kv.swap_in(r)
    assert [c for c, _ in back] == [c for _, c in out]
    assert len(kv.free_cpu_blocks) == 4 and kv.num_blocks_of("r") == 3
    kv.free(r)
    big = make_request("big", range(1, 30))
    admit(kv, big, compute=False)
    assert kv.num_blocks_of("big") == 8
    assert not kv.can_swap_out(big)  # 8 blocks do not fit in 4 CPU blocks


def test_fragmentation_and_usage():
    kv = manager(num_blocks=10, prefix=False)
    r = make_request("r", range(1, 6))  # 5 tokens in 2 blocks of 4: 3 of 8 slots unused
    admit(kv, r)
    assert abs(kv.usage() - 0.2) < 1e-9
    assert abs(kv.fragmentation([r]) - 3 / 8) < 1e-9


def test_free_queue_operations_are_constant_time_links():
    pool = BlockPool(5, True)
    b = pool.blocks[2]
    pool.touch([b])  # unlink from the middle
    assert [x.block_id for x in pool.free_queue] == [0, 1, 3, 4] and pool.num_free_blocks == 4
    pool.free([b])  # unhashed: back to the head
    assert [x.block_id for x in pool.free_queue] == [2, 0, 1, 3, 4]
