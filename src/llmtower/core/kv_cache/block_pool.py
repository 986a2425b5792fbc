"""The pool of physical KV blocks: O(1) allocation and free, reference counts, and the
hash -> block map of the prefix cache.

  free list (doubly linked, allocation pops from the head):
  head ⇄ [unhashed blocks …] ⇄ [hashed blocks, least recently freed first …] ⇄ tail

- Unhashed (partial) blocks hold nothing reusable, so they are freed to the *head*: they are
  reused first and never push a cached block out.
- Hashed blocks are freed to the *tail*, so the head holds the least recently used one; a
  request frees its blocks in reverse order, so its tail blocks are evicted before the prefix
  blocks that other requests are more likely to share.
- A free hashed block keeps its hash and content until it is popped for reuse (eviction); a
  prefix-cache hit on it "touches" it: unlinks it from the list in O(1) and raises its ref count.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator


class KVCacheBlock:
    """One physical block: its id, reference count, hash (if full and cached) and free-list links."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with sentinels: every operation is O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free = 0
        # One byte per block id, 1 while the block is on the list: the operator tools find
        # free runs (fragmentation) with C-speed byte scans instead of walking the list.
        self.free_map = bytearray(len(blocks))
        # Linked in one pass (what ``append`` does block by block): a pool holds up to
        # hundreds of thousands of blocks, built once per engine and per simulated replica.
        free_map = self.free_map
        prev = self.head
        for b in blocks:
            b.prev_free = prev
            prev.next_free = b
            free_map[b.block_id] = 1
            prev = b
        prev.next_free = self.tail
        self.tail.prev_free = prev
        self.num_free = len(blocks)

    def _link_after(self, prev: KVCacheBlock, block: KVCacheBlock) -> None:
        nxt = prev.next_free
        block.prev_free, block.next_free = prev, nxt
        prev.next_free = block
        nxt.prev_free = block  # type: ignore[union-attr]
        self.num_free += 1
        self.free_map[block.block_id] = 1

    def append(self, block: KVCacheBlock) -> None:
        self._link_after(self.tail.prev_free, block)  # type: ignore[arg-type]

    def appendleft(self, block: KVCacheBlock) -> None:
        self._link_after(self.head, block)

    def remove(self, block: KVCacheBlock) -> None:
        block.prev_free.next_free = block.next_free  # type: ignore[union-attr]
        block.next_free.prev_free = block.prev_free  # type: ignore[union-attr]
        block.prev_free = block.next_free = None
        self.num_free -= 1
        self.free_map[block.block_id] = 0

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        if block is self.tail:
            raise RuntimeError("no free KV block left")
        self.remove(block)  # type: ignore[arg-type]
        return block  # type: ignore[return-value]

    def popleft_many(self, n: int) -> list[KVCacheBlock]:
        """The ``n`` blocks at the head, unlinked (``n`` <= ``num_free``): what ``n`` calls of
        ``popleft`` return, in one pass (an allocation takes a prompt's worth at once)."""
        if n > self.num_free:
            raise RuntimeError("no free KV block left")
        head = self.head
        free_map = self.free_map
        out: list[KVCacheBlock] = []
        b: KVCacheBlock = head.next_free  # type: ignore[assignment]
        for _ in range(n):
            out.append(b)
            free_map[b.block_id] = 0
            nxt = b.next_free
            b.prev_free = b.next_free = None
            b = nxt  # type: ignore[assignment]
        head.next_free = b
        b.prev_free = head
        self.num_free -= n
        return out

    def link_released(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in order; one reaching zero is linked as
        ``appendleft`` (unhashed: reused first) or ``append`` (hashed: evicted last) would."""
        head = self.head
        tail = self.tail
        free_map = self.free_map
        linked = 0
        for b in blocks:
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                prev = head if b.block_hash is None else tail.prev_free
                nxt = prev.next_free  # type: ignore[union-attr]
                b.prev_free, b.next_free = prev, nxt
                prev.next_free = b  # type: ignore[union-attr]
                nxt.prev_free = b  # type: ignore[union-attr]
                free_map[b.block_id] = 1
                linked += 1
        self.num_free += linked

    def __iter__(self) -> Iterator[KVCacheBlock]:
        b = self.head.next_free
        while b is not None and b is not self.tail:
            yield b
            b = b.next_free


class BlockPool:
    """Owns every device KV block, the free list and the prefix-cache hash map."""

    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[bytes, KVCacheBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including cached blocks nobody uses)."""
        return self.free_queue.num_free

    def usage(self) -> float:
        return 1.0 - self.free_queue.num_free / self.num_blocks

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, unlinking free ones from the free list."""
        for b in blocks:
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1

    def allocate(self, n: int) -> list[KVCacheBlock]:
        if n > self.free_queue.num_free:
            raise RuntimeError(f"cannot allocate {n} blocks: only {self.free_queue.num_free} free")
        out = self.free_queue.popleft_many(n)
        for b in out:
            if b.block_hash is not None:  # evict: its content is about to be overwritten
                del self.cached[b.block_hash]
                b.block_hash = None
                self.num_evictions += 1
            b.ref_cnt = 1
        return out

    def allocate_one(self) -> KVCacheBlock:
        """``allocate(1)``'s block, without the list (a decode crossing into a new block)."""
        block = self.free_queue.popleft()
        if block.block_hash is not None:
            del self.cached[block.block_hash]
            block.block_hash = None
            self.num_evictions += 1
        block.ref_cnt = 1
        return block

    def free(self, blocks_in_free_order) -> None:
        """Drop one reference from each block; a block reaching zero joins the free list."""
        self.free_queue.link_released(blocks_in_free_order)

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its hash, unless an equal block is cached already
        (two requests computed the same prefix at once: the first one stays the cached copy)."""
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash; blocks in use keep their content but are no longer shared."""
        for b in self.cached.values():
            b.block_hash = None
        self.cached.clear()
        # Formerly hashed free blocks are now plain free blocks; their order no longer matters.
