"""Swap-slot bookkeeping of a swap space that holds blocks as they are and compressed: a
compressed request takes fewer slots, so more requests fit; the (block, slot) pairs name each
block's slots in order; swap-in, finish and abort give every slot back."""
from __future__ import annotations

from llmtower.core.config import CacheConfig
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.swap_layout import SwapLayout
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams

LAYOUT = SwapLayout(7, 2)


def manager(num_cpu_slots: int = 26, swap_space_dtype: str = "auto") -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=4, num_blocks=16, num_cpu_blocks=num_cpu_slots,
                                      enable_prefix_caching=False, swap_layout=LAYOUT,
                                      swap_space_dtype=swap_space_dtype))


def running(kv: KVCacheManager, rid: str, num_tokens: int) -> Request:
    r = Request(rid, list(range(1, num_tokens + 1)), SamplingParams(max_tokens=4))
    assert kv.allocate_slots(r, num_tokens) is not None
    r.num_computed_tokens = num_tokens
    return r


def test_compressed_swap_takes_fewer_slots_and_comes_back_whole():
    kv = manager()
    a, b, c = (running(kv, x, 12) for x in "abc")  # 3 blocks each
    # 26 slots: one request as it is (21 slots), or four compressed (6 slots each)
    assert kv.can_swap_out(a) and kv.can_swap_out(a, compressed=True)
    out_int8: list[int] = []
    pairs = kv.swap_out(a, compressed=True, compressed_blocks=out_int8)
    assert len(pairs) == 6 and len(kv.free_cpu_blocks) == 20
    assert [d for d, _ in pairs] == [out_int8[0]] * 2 + [out_int8[1]] * 2 + [out_int8[2]] * 2
    assert kv.num_swapped_blocks("a") == 3
    assert not kv.can_swap_out(b)  # 21 slots as it is: no longer fits ...
    assert kv.can_swap_out(b, compressed=True)  # ... compressed it does
    kv.swap_out(b, compressed=True)
    kv.swap_out(c, compressed=True)
    assert len(kv.free_cpu_blocks) == 8 and kv.pool.num_free_blocks == 16
    in_int8: list[int] = []
    back = kv.swap_in(a, compressed_blocks=in_int8)
    assert [s for s, _ in back] == [s for _, s in pairs]  # the same slots, in order
    assert [d for _, d in back][::2] == in_int8 == kv.get_block_ids("a")
    assert "a" not in kv.swapped_compressed and len(kv.free_cpu_blocks) == 14
    kv.free(b)  # finished or aborted while swapped: its slots come back too
    kv.free(c)
    kv.free(a)
    assert len(kv.free_cpu_blocks) == 26 and not kv.swapped_compressed
    assert sorted(kv.free_cpu_blocks) == list(range(26))


def test_uncompressed_swap_in_a_mixed_swap_space():
    kv = manager()
    a = running(kv, "a", 9)  # 3 blocks
    pairs = kv.swap_out(a)
    assert len(pairs) == 21 and len({s for _, s in pairs}) == 21
    back = kv.swap_in(a, compressed_blocks=(got := []))
    assert got == [] and len(back) == 21 and kv.num_blocks_of("a") == 3


def test_swap_space_dtype_int8_compresses_every_swap():
    assert manager(swap_space_dtype="int8").compress_swap(0)
    auto = manager()
    assert not auto.compress_swap(0) and not auto.compress_swap(1)
    assert auto.compress_swap(2) and auto.compress_swap(4)  # degradation level 2 on
    plain = KVCacheManager(CacheConfig(block_size=4, num_blocks=16, num_cpu_blocks=4,
                                       swap_space_dtype="int8"))
    assert not plain.compress_swap(4)  # a plain layout (an int8 KV cache) never compresses
