"""How scattered the KV cache is: runs of consecutive free blocks and of consecutive block ids
in block tables.

Two kinds of fragmentation matter to a paged cache:

- *internal*: slots of allocated blocks that hold no token (the tail of each request's last
  block, and blocks allocated ahead of tokens). ``KVCacheManager.fragmentation`` measures it.
- *external*: the free blocks and the block tables are cut into many short runs. A paged
  cache never fails an allocation because of it, but scattered block tables make attention
  read memory in short pieces, and a relocator or a contiguous allocation needs long runs.
  ``external_fragmentation`` is the classic ``1 - largest free run / free blocks``: 0 when
  all free blocks are one run, close to 1 when none of them touch.

Free runs come from ``FreeBlockQueue.free_map`` (one byte per block), split at C speed, so
the figure is cheap enough for every stats snapshot even on 100k blocks.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from llmtower.core.kv_cache.block_pool import BlockPool


@dataclass(frozen=True)
class FreeRuns:
    """Runs of consecutive free block ids: how many, the longest, and the free total."""

    num_runs: int
    largest: int
    num_free: int

    @property
    def mean(self) -> float:
        return self.num_free / self.num_runs if self.num_runs else 0.0

    @property
    def external_fragmentation(self) -> float:
        return 1.0 - self.largest / self.num_free if self.num_free else 0.0


def free_runs(pool: BlockPool) -> FreeRuns:
    """The free runs of ``pool`` (O(num_blocks) in C, no Python loop over blocks)."""
    runs = [len(r) for r in bytes(pool.free_queue.free_map).split(b"\x00") if r]
    return FreeRuns(len(runs), max(runs, default=0), pool.free_queue.num_free)


def external_fragmentation(pool: BlockPool) -> float:
    return free_runs(pool).external_fragmentation


def block_runs(block_ids: list[int]) -> list[tuple[int, int]]:
    """A block table as (first id, length) runs of consecutive ids, in table order."""
    if not block_ids:
        return []
    # Indices where a run starts: the first, and wherever an id does not follow the last.
    starts = [0]
    starts += [i for i, (prev, cur) in enumerate(pairwise(block_ids), 1)
               if cur != prev + 1]
    ends = starts[1:] + [len(block_ids)]
    return [(block_ids[s], e - s) for s, e in zip(starts, ends)]
