"""Pinned prefix blocks: cached blocks kept out of LRU eviction (``llmtower preload --pin``).

A pin is one reference on a cached block held by no request, so the block never returns to
the free list while pinned: it cannot be evicted, and a request that hits it shares it as it
would any cached block. ``unpin_all`` drops those references; blocks nobody else uses go back
to the free list (still cached, the LRU tail, like any freed prefix block).
"""
from __future__ import annotations

from llmtower.core.kv_cache.block_pool import BlockPool, KVCacheBlock


class PinnedBlocks:
    """Owns the pin references on cached blocks, in pin order, up to ``max_blocks``."""

    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max_blocks
        self.blocks: list[KVCacheBlock] = []
        self._hashes: set[bytes] = set()

    def __len__(self) -> int:
        return len(self.blocks)

    def pin(self, block_hashes: list[bytes]) -> tuple[int, int]:
        """Pin the cached blocks of a prefix (its chained hashes, in order), stopping at the
        first one not cached or at the budget. Returns (newly pinned, already pinned)."""
        new = already = 0
        for h in block_hashes:
            if h in self._hashes:
                already += 1
                continue
            b = self.pool.cached.get(h)
            if b is None or len(self.blocks) >= self.max_blocks:
                break
            self.pool.touch([b])
            self.blocks.append(b)
            self._hashes.add(h)
            new += 1
        return new, already

    def unpin_all(self) -> int:
        """Release every pin; returns how many blocks were pinned."""
        n = len(self.blocks)
        # Free in reverse: the tail of each prefix is evicted before its head, as for requests.
        self.pool.free(reversed(self.blocks))
        self.blocks = []
        self._hashes.clear()
        return n
