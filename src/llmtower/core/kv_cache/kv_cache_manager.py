"""Per-request KV block bookkeeping on top of the BlockPool, plus CPU swap space.

  request "r1", block_size 4, 10 tokens (9 computed):
      logical  0        1        2
             ┌────┐   ┌────┐   ┌────┐
  blocks ──▶ │ 7  │ ─ │ 3  │ ─ │ 12 │        physical ids from the pool (block table)
             └────┘   └────┘   └────┘
              full     full    2 of 4 used (fragmentation: 2 unused slots)
              hashed   hashed  unhashed

Invariants: a request's list holds exactly ceil(tokens_allocated / block_size) blocks; the
first ``num_cached_blocks[r]`` of them are registered in the prefix cache; an allocation
either succeeds whole or changes nothing.

Sliding windows (``CacheConfig.sliding_window``: every layer of the model windowed): a query
at position p reads only keys > p - window, so once a request's next query is past a block's
window the block is returned to the pool (a cached one keeps its hash there, for prefix hits,
until evicted). Its place in the list is kept by ``null_block`` (the first
``num_dead_blocks[r]`` entries), so that positions still index the list; the runner's table
keeps the old id there, which attention never reads (models/attention.py). A request then
holds about ceil(window / block_size) + 1 blocks, however long it runs.
"""
from __future__ import annotations

from llmtower.core.config import CacheConfig
from llmtower.core.kv_cache.block_hash import extend_block_hashes
from llmtower.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmtower.core.kv_cache.extra_keys import block_extra_key
from llmtower.core.kv_cache.pinned import PinnedBlocks
from llmtower.core.request import Request
from llmtower.utils import cdiv


class KVCacheManager:
    """Owns each request's block table, the prefix-cache lookups and the CPU swap blocks."""

    def __init__(self, cache_config: CacheConfig) -> None:
        self.block_size = cache_config.block_size
        self.enable_prefix_caching = cache_config.enable_prefix_caching
        self.pool = BlockPool(cache_config.num_blocks, cache_config.enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        self.window = cache_config.sliding_window  # None: every block stays
        # Stands in for a block returned because it left the window; never in the pool.
        self.null_block = KVCacheBlock(0)
        self.num_dead_blocks: dict[str, int] = {}  # leading null_block entries per request
        # CPU swap space: a stack of free swap slots (O(1) both ways). In the plain layout a
        # slot is a block; where swap-outs may be compressed, a block takes
        # swap_layout.slots_per_block slots, or slots_per_compressed_block as int8.
        self.num_cpu_blocks = cache_config.num_cpu_blocks
        self.free_cpu_blocks: list[int] = list(range(cache_config.num_cpu_blocks - 1, -1, -1))
        self.req_to_cpu_blocks: dict[str, list[int]] = {}  # each block's slots, in order
        self.swap_layout = cache_config.swap_layout
        self.compress_always = (cache_config.swap_space_dtype == "int8"
                                and cache_config.swap_layout.compressible)
        self.swapped_compressed: set[str] = set()  # requests whose swapped blocks are int8
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found
        # Preloaded prefixes kept out of eviction (0: up to a quarter of the blocks).
        self.pinned = PinnedBlocks(self.pool, cache_config.max_pinned_blocks
                                   or max(1, cache_config.num_blocks // 4))

    # ------------------------------------------------------------------ prefix cache
    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, as (blocks, tokens).

        The last token is always recomputed, even on a full hit, because the forward pass
        needs at least one token to produce the logits of the next one.
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        extend_block_hashes(request.block_hashes, request.all_token_ids, bs,
                            request.num_tokens, block_extra_key(request))
        max_blocks = (request.num_tokens - 1) // bs
        hashes = request.block_hashes
        cached = self.pool.cached
        blocks: list[KVCacheBlock] = []
        for i in range(min(max_blocks, len(hashes))):
            b = cached.get(hashes[i])
            if b is None:
                break
            blocks.append(b)
        return blocks, len(blocks) * bs

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's newly full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        # Only blocks whose tokens are all known: under --async-scheduling the computed count
        # already covers the input of a step in flight, a token not sampled yet, and a block
        # hashed without it would be registered under the hash of its first slots alone.
        token_ids = request.all_token_ids
        bs = self.block_size
        num_full = min(num_computed_tokens, len(token_ids)) // bs
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        blocks = self.req_to_blocks[rid]
        hashes = request.block_hashes
        if len(hashes) < num_full:
            extend_block_hashes(hashes, token_ids, bs, num_full * bs, block_extra_key(request))
        if self.num_dead_blocks:
            start = max(start, self.num_dead_blocks.get(rid, 0))
        # pool.cache_block for each, in order (this runs for every block a request fills).
        cached = self.pool.cached
        for i in range(start, num_full):
            b = blocks[i]
            h = hashes[i]
            if b.block_hash is None and h not in cached:
                b.block_hash = h
                cached[h] = b
        self.num_cached_blocks[rid] = num_full

    def cache_next_block(self, request: Request, num_computed_tokens: int) -> None:
        """``cache_blocks`` where at most one more block is full and its hash is known
        (``hash_full_blocks``): a decode filling its block, once per block and step."""
        rid = request.request_id
        index = num_computed_tokens // self.block_size - 1
        if index != self.num_cached_blocks.get(rid, 0) or self.num_dead_blocks \
                or index >= len(request.block_hashes):
            self.cache_blocks(request, num_computed_tokens)  # none, several, or unhashed
            return
        b = self.req_to_blocks[rid][index]
        h = request.block_hashes[index]
        cached = self.pool.cached
        if b.block_hash is None and h not in cached:
            b.block_hash = h
            cached[h] = b
        self.num_cached_blocks[rid] = index + 1

    def hash_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Compute the hashes of the request's full blocks among its first ``num_tokens``
        tokens ahead of their registration (``cache_blocks`` then only registers them): one
        pass for the blocks a run of decode steps fills, rather than one call per block."""
        hashes = request.block_hashes
        # (The extra key is part of the first block's hash only.)
        extend_block_hashes(hashes, request.all_token_ids, self.block_size, num_tokens,
                            None if hashes else block_extra_key(request))

    def uncache_blocks(self, request: Request, start: int) -> None:
        """Take the request's blocks from index ``start`` on out of the prefix cache: they were
        registered when a step was scheduled, and that step will not compute them after all
        (the request was preempted before it ran)."""
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid, ())
        cached = self.pool.cached
        for b in blocks[start:self.num_cached_blocks.get(rid, 0)]:
            if b.block_hash is not None and cached.get(b.block_hash) is b:
                del cached[b.block_hash]
                b.block_hash = None
        if rid in self.num_cached_blocks:
            self.num_cached_blocks[rid] = min(start, self.num_cached_blocks[rid])

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block, only when no block is in use (as vLLM): returns False,
        changing nothing, while any request holds blocks, since their hashes would otherwise
        have to be dropped from under them."""
        if self.pool.num_free_blocks < self.pool.num_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True

    # ------------------------------------------------------------------ allocation
    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_new_computed_tokens: int = 0) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        Returns the newly allocated blocks (prefix hits excluded), or None when there are not
        enough free blocks, in which case nothing changed (no ref count, no free list).
        """
        rid = request.request_id
        req_blocks = self.req_to_blocks.get(rid)
        num_existing = len(req_blocks) if req_blocks is not None else 0
        if self.window is not None and req_blocks is not None:
            self._free_outside_window(rid, req_blocks, request.num_computed_tokens)
        total = request.num_computed_tokens + num_new_computed_tokens + num_new_tokens
        num_required = cdiv(total, self.block_size)
        if not new_computed_blocks and req_blocks is not None and num_required <= num_existing:
            return []  # the common decode step: the current block still has room
        hits = new_computed_blocks or []
        num_new_blocks = max(0, num_required - num_existing - len(hits))
        # Free cached blocks we are about to reuse leave the free list too.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks > self.pool.num_free_blocks - num_free_hits:
            return None
        if req_blocks is None:
            req_blocks = self.req_to_blocks[rid] = []
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_new_computed_tokens
        if hits:
            self.pool.touch(hits)
            req_blocks.extend(hits)
            self.num_cached_blocks[rid] = len(req_blocks)
        new_blocks = self.pool.allocate(num_new_blocks) if num_new_blocks else []
        req_blocks.extend(new_blocks)
        return new_blocks

    def _free_outside_window(self, rid: str, blocks: list[KVCacheBlock], computed: int) -> None:
        """Return the blocks wholly before the window of the request's last computed token
        (position ``computed - 1`` sees keys >= computed - window: under --async-scheduling
        it may be the query of the step in flight; later queries see less)."""
        assert self.window is not None
        upto = min(max(0, computed - self.window) // self.block_size, len(blocks))
        dead = self.num_dead_blocks.get(rid, 0)
        if upto <= dead:
            return
        gone = blocks[dead:upto]
        blocks[dead:upto] = [self.null_block] * (upto - dead)
        self.num_dead_blocks[rid] = upto
        self.pool.free(reversed(gone))

    def free_outside_window(self, request: Request) -> None:
        """``_free_outside_window`` for a request scheduled without an allocation (a decode
        whose last block has room)."""
        blocks = self.req_to_blocks.get(request.request_id)
        if self.window is not None and blocks:
            self._free_outside_window(request.request_id, blocks, request.num_computed_tokens)

    def live_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's blocks still held (past those its window left)."""
        return self.req_to_blocks.get(request_id, [])[self.num_dead_blocks.get(request_id, 0):]

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so that its tail is evicted first."""
        rid = request.request_id
        blocks = self.req_to_blocks.pop(rid, None)
        self.num_cached_blocks.pop(rid, None)
        dead = self.num_dead_blocks.pop(rid, 0)
        if blocks:
            self.pool.free(reversed(blocks[dead:]))
        cpu = self.req_to_cpu_blocks.pop(rid, None)
        if cpu:
            self.free_cpu_blocks.extend(cpu)
            self.swapped_compressed.discard(rid)

    def block_tables(self) -> list[list[KVCacheBlock]]:
        """Every holder's device blocks (what the relocator packs)."""
        if self.num_dead_blocks:
            tables = [self.live_blocks(rid) for rid in self.req_to_blocks]
        else:
            tables = list(self.req_to_blocks.values())
        if self.pinned.blocks:
            tables.append(self.pinned.blocks)
        return tables

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> int:
        """Release the request's blocks past the first ``ceil(num_tokens / block_size)``
        (those that only held rejected draft tokens); returns how many. Never a cached block:
        cached blocks are full of computed tokens, and those are all below ``num_tokens``."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if not blocks or len(blocks) <= keep:
            return 0
        tail = blocks[keep:]
        del blocks[keep:]
        self.pool.free(reversed(tail))
        return len(tail)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def num_blocks_of(self, request_id: str) -> int:
        """Blocks the request holds (those its window left not counted)."""
        return len(self.req_to_blocks.get(request_id, ())) - self.num_dead_blocks.get(request_id, 0)

    # ------------------------------------------------------------------ swap
    def compress_swap(self, degradation_level: int) -> bool:
        """Whether a swap-out now stores int8 blocks: always under --swap-space-dtype int8,
        else from degradation level 2 (compress) on, where the layout allows it."""
        return self.compress_always or (degradation_level >= 2 and self.swap_layout.compressible)

    def can_swap_out(self, request: Request, compressed: bool = False) -> bool:
        need = self.num_blocks_of(request.request_id) * self.swap_layout.slots_for(compressed)
        return need <= len(self.free_cpu_blocks)

    def swap_out(self, request: Request, compressed: bool = False,
                 compressed_blocks: list[int] | None = None) -> list[tuple[int, int]]:
        """Move the request's blocks to swap slots; returns (device block, slot) copy pairs,
        each block's slots consecutive and in order. ``compressed``: stored as int8 (their
        device ids are appended to ``compressed_blocks``, for the executor)."""
        rid = request.request_id
        # Blocks its window left stay gone (num_dead_blocks is kept for swap_in).
        blocks = self.req_to_blocks.pop(rid)[self.num_dead_blocks.get(rid, 0):]
        self.num_cached_blocks.pop(rid, None)
        per = self.swap_layout.slots_for(compressed)
        free = self.free_cpu_blocks
        cpu = [free.pop() for _ in range(len(blocks) * per)]
        self.req_to_cpu_blocks[rid] = cpu
        pairs = [(b.block_id, cpu[j * per + s]) for j, b in enumerate(blocks) for s in range(per)]
        if compressed:
            self.swapped_compressed.add(rid)
            if compressed_blocks is not None:
                compressed_blocks.extend(b.block_id for b in blocks)
        # The device copies stay cached for other requests; the executor copies them out
        # before this step's forward pass overwrites anything.
        self.pool.free(reversed(blocks))
        return pairs

    def num_swapped_blocks(self, request_id: str) -> int:
        """Blocks a swapped-out request holds in the swap space."""
        cpu = self.req_to_cpu_blocks.get(request_id, ())
        return len(cpu) // self.swap_layout.slots_for(request_id in self.swapped_compressed)

    def can_swap_in(self, request: Request, num_new_tokens: int) -> bool:
        dead = self.num_dead_blocks.get(request.request_id, 0)
        need = max(self.num_swapped_blocks(request.request_id),
                   cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - dead)
        return need <= self.pool.num_free_blocks

    def swap_in(self, request: Request, compressed_blocks: list[int] | None = None
                ) -> list[tuple[int, int]]:
        """Bring the request's swapped blocks back into new device blocks; (slot, device
        block) pairs, each block's slots consecutive and in order. Blocks that were stored
        as int8 have their device ids appended to ``compressed_blocks``."""
        rid = request.request_id
        per = self.swap_layout.slots_for(rid in self.swapped_compressed)
        cpu = self.req_to_cpu_blocks.pop(rid)
        dead = self.num_dead_blocks.get(rid, 0)
        live = self.pool.allocate(len(cpu) // per)
        self.req_to_blocks[rid] = [self.null_block] * dead + live
        self.num_cached_blocks[rid] = 0
        self.free_cpu_blocks.extend(cpu)
        if rid in self.swapped_compressed:
            self.swapped_compressed.discard(rid)
            if compressed_blocks is not None:
                compressed_blocks.extend(b.block_id for b in live)
        return [(c, live[i // per].block_id) for i, c in enumerate(cpu)]

    # ------------------------------------------------------------------ statistics
    def usage(self) -> float:
        return self.pool.usage()

    def fragmentation(self, requests) -> float:
        """Slots allocated but holding no token, as a ratio of allocated slots."""
        allocated = used = 0
        for r in requests:
            n = len(self.req_to_blocks.get(r.request_id, ()))
            dead = self.num_dead_blocks.get(r.request_id, 0)
            if n > dead:
                allocated += (n - dead) * self.block_size
                used += min(r.num_computed_tokens, n * self.block_size) - dead * self.block_size
        return (allocated - used) / allocated if allocated else 0.0
