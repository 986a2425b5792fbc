"""The block relocator: measures external fragmentation of the KV pool and plans block moves
that make every request's block table one contiguous run and the free space one run.

  before (ids 0..11)               after a full defragmentation
  ┌──┬──┬──┬──┬──┬──┬──┬──┬──┬──┐   ┌──┬──┬──┬──┬──┬──┬──┬──┬──┬──┐
  │a0│  │b0│a1│  │b1│  │a2│  │  │   │a0│a1│a2│b0│b1│  │  │  │  │  │
  └──┴──┴──┴──┴──┴──┴──┴──┴──┴──┘   └──┴──┴──┴──┴──┴──┴──┴──┴──┴──┘

A move ``(src, dst)`` copies the K/V of physical block ``src`` into ``dst``. All moves of one
batch are performed gather-then-scatter (every source is read before any target is written), so
a batch may rotate blocks along a cycle. The bookkeeping is updated by *relabelling*: a
``KVCacheBlock`` object stands for one logical block (its reference count, prefix-cache hash and
free-list position are on the object, and request block tables, the hash map and the free list
hold the object), so a move only changes ``obj.block_id`` and ``pool.blocks[...]``. Block
tables, hashes and reference counts therefore change together, in O(moves), and nothing else
needs rewriting on the scheduler side; the executor remaps the block ids in its block tables.

Which blocks carry content: blocks in use (``ref_cnt > 0``) and free blocks that are still in
the prefix cache (hashed). Unhashed free blocks hold nothing anyone will read; they fill the
vacated places without a copy.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from llmtower.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from llmtower.core.kv_cache.fragmentation import external_fragmentation

Move = tuple[int, int]


def table_fragmentation(tables: Iterable[Sequence[KVCacheBlock]]) -> float:
    """Share of a table's consecutive private blocks (``ref_cnt == 1``, shared blocks between
    them skipped) that are not physically adjacent: 0 when every table's private blocks are
    one run of consecutive ids, which is what ``target_layout`` makes. A block shared by
    several requests can sit next to only one of them, so it counts for none."""
    breaks = possible = 0
    for table in tables:
        prev = None
        for b in table:
            if b.ref_cnt != 1:
                continue
            if prev is not None:
                possible += 1
                if b.block_id != prev.block_id + 1:
                    breaks += 1
            prev = b
    return breaks / possible if possible else 0.0


def layout_fragmentation(pool: BlockPool, tables: Sequence[Sequence[KVCacheBlock]]) -> float:
    """What the relocator compares with its threshold: the worse of the free space's external
    fragmentation (``1 - largest free run / free blocks``) and ``table_fragmentation``."""
    return max(external_fragmentation(pool), table_fragmentation(tables))


class DefragResult(msgspec.Struct, kw_only=True):
    """What one on-demand defragmentation did (an engine utility's answer, so a struct)."""

    engine_index: int = 0  # set by the API process: an engine does not know its DP index
    num_moves: int = 0
    fragmentation_before: float = 0.0  # layout_fragmentation
    fragmentation_after: float = 0.0
    free_fragmentation_before: float = 0.0  # external_fragmentation (free runs only)
    free_fragmentation_after: float = 0.0
    table_fragmentation_before: float = 0.0
    table_fragmentation_after: float = 0.0


def target_layout(pool: BlockPool, tables: Sequence[Sequence[KVCacheBlock]]) -> list[int]:
    """``target[p]``: where the block now at physical id ``p`` should live.

    Every table's private blocks (``ref_cnt == 1``) become one run, in table order. Tables
    are packed from id 0 in the order of their lowest private block id; each one first
    places the shared blocks no earlier table placed, then its private run, so a shared
    prefix sits just before its first owner's private blocks. A shared block is never placed
    *between* a table's private blocks: a prefix hit can share a table's middle (a request
    swapped back in holds private copies of a prefix whose later blocks another request
    hits), and placing it at its first owner's place would split that owner's run. The
    order key makes the target its own fixed point (a packed layout stays put): private
    runs keep their order, so the tables do. Shared blocks that only tables without private
    blocks hold follow, in id order; cached free blocks keep their place if it is past the
    packed region, else move to the first places there that hold an unhashed free block;
    unhashed free blocks take what is left (they carry nothing).
    """
    n = pool.num_blocks
    blocks = pool.blocks
    target = [-1] * n
    taken = [False] * n
    nxt = 0
    owners = []
    for table in tables:
        first_private = min((b.block_id for b in table if b.ref_cnt == 1), default=-1)
        if first_private >= 0:
            owners.append((first_private, table))
    owners.sort(key=lambda o: o[0])  # private blocks belong to one table: keys are distinct
    for _, table in owners:
        for private in (False, True):
            for b in table:
                p = b.block_id
                if (b.ref_cnt == 1) == private and target[p] < 0:
                    target[p] = nxt
                    taken[nxt] = True
                    nxt += 1
    for p in range(n):  # in use by tables without private blocks only, or by no table given
        if target[p] < 0 and blocks[p].ref_cnt > 0:
            target[p] = nxt
            taken[nxt] = True
            nxt += 1
    packed = nxt
    # Cached free blocks inside the packed region move to the first places past it that do
    # not hold another cached free block (there are always enough: see the counts).
    spare = [p for p in range(n - 1, packed - 1, -1)
             if blocks[p].ref_cnt > 0 or blocks[p].block_hash is None]
    for p in range(n):
        b = blocks[p]
        if target[p] >= 0 or b.block_hash is None:
            continue
        target[p] = p if p >= packed else spare.pop()
        taken[target[p]] = True
    # Unhashed free blocks keep their place when nobody takes it, else fill the gaps.
    for p in range(n):
        if target[p] < 0 and not taken[p]:
            target[p] = p
            taken[p] = True
    left = [q for q in range(n - 1, -1, -1) if not taken[q]]
    for p in range(n):
        if target[p] < 0:
            target[p] = left.pop()
    return target


def select_moves(pool: BlockPool, target: list[int], budget: int,
                 frozen: set[int] | frozenset[int] = frozenset()) -> list[Move]:
    """At most ``budget`` content moves towards ``target`` that are valid as one
    gather-then-scatter batch, never moving a block in ``frozen`` (blocks this step writes).

    The permutation splits into cycles. In a cycle that passes through unhashed free blocks,
    each run of content blocks ending in a free one is a chain that can be shifted by any
    number of steps from its free end. A cycle of content blocks only is rotated whole if
    the budget allows, else opened with one move into a free block that is already in place.
    """
    blocks = pool.blocks
    n = len(target)
    seen = [False] * n
    moves: list[Move] = []
    # Free unhashed blocks already in place: temporary homes that open content-only cycles.
    fixed_free = [p for p in range(n - 1, -1, -1) if target[p] == p
                  and blocks[p].ref_cnt == 0 and blocks[p].block_hash is None]

    def content(p: int) -> bool:
        b = blocks[p]
        return b.ref_cnt > 0 or b.block_hash is not None

    for start in range(n):
        if len(moves) >= budget:
            break
        if seen[start] or target[start] == start:
            continue
        cycle = [start]
        seen[start] = True
        p = target[start]
        while p != start:
            seen[p] = True
            cycle.append(p)
            p = target[p]
        k = len(cycle)
        free_idx = [i for i in range(k) if not content(cycle[i])]
        if not free_idx:
            if k <= budget - len(moves) and not any(c in frozen for c in cycle):
                moves.extend((cycle[i], cycle[(i + 1) % k]) for i in range(k))
            elif fixed_free:
                for c in cycle:
                    if c not in frozen:
                        moves.append((c, fixed_free.pop()))
                        break
            continue
        for i in free_idx:
            # The chain ending in the free block at cycle[i]: cycle[i-1] -> cycle[i], ...
            j = (i - 1) % k
            while content(cycle[j]) and cycle[j] not in frozen and len(moves) < budget:
                moves.append((cycle[j], cycle[(j + 1) % k]))
                j = (j - 1) % k
    return moves


def apply_moves(pool: BlockPool, moves: Sequence[Move]) -> None:
    """Relabel the pool after ``moves`` (one gather-then-scatter batch): each moved block
    object takes its new id; the unhashed free blocks it displaced take the vacated ids."""
    if not moves:
        return
    blocks = pool.blocks
    srcs = {s for s, _ in moves}
    dsts = {d for _, d in moves}
    if len(srcs) != len(moves) or len(dsts) != len(moves):
        raise ValueError("a block appears twice as a source or twice as a target in one batch")
    displaced = sorted(dsts - srcs)
    vacated = sorted(srcs - dsts)
    new_at: dict[int, KVCacheBlock] = {}
    for s, d in moves:
        new_at[d] = blocks[s]
    for x, v in zip(displaced, vacated):
        b = blocks[x]
        if b.ref_cnt != 0 or b.block_hash is not None:
            raise ValueError(f"move target {x} holds a block in use or in the prefix cache")
        new_at[v] = b
    free_map = pool.free_queue.free_map
    for i, b in new_at.items():
        blocks[i] = b
        b.block_id = i
        free_map[i] = b.ref_cnt == 0  # a block is on the free list exactly when unreferenced


def sort_unhashed_free(pool: BlockPool) -> None:
    """Order the unhashed part of the free list (its head) by block id, so that the next
    allocations after a defragmentation hand out consecutive ids."""
    q = pool.free_queue
    unhashed: list[KVCacheBlock] = []
    for b in q:
        if b.block_hash is not None:
            break  # hashed blocks follow every unhashed one (see BlockPool)
        unhashed.append(b)
    for b in unhashed:
        q.remove(b)
    for b in sorted(unhashed, key=lambda b: b.block_id, reverse=True):
        q.appendleft(b)


class BlockRelocator:
    """Owns the defragmentation policy of one KV pool: when to start (external fragmentation
    above ``threshold``), how many block copies a step may spend (``max_moves_per_step``), and
    the counters of what it moved. The scheduler asks it for each step's moves."""

    def __init__(self, pool: BlockPool, threshold: float, max_moves_per_step: int) -> None:
        self.pool = pool
        self.threshold = threshold
        self.max_moves_per_step = max_moves_per_step
        self.active = False  # a defragmentation is under way (until nothing is left to move)
        self.num_moves_total = 0
        self.num_defrags_started = 0
        self.last_fragmentation = 0.0

    def plan_step(self, tables: Sequence[Sequence[KVCacheBlock]],
                  frozen: set[int]) -> list[Move]:
        """This step's moves (already applied to the pool's bookkeeping), or none."""
        frag = layout_fragmentation(self.pool, tables)
        self.last_fragmentation = frag
        if not self.active:
            if frag <= self.threshold or frag == 0.0:
                return []
            self.active = True
            self.num_defrags_started += 1
        target = target_layout(self.pool, tables)
        moves = select_moves(self.pool, target, self.max_moves_per_step, frozen)
        if not moves and not frozen.intersection(p for p in range(len(target)) if target[p] != p):
            self.active = False  # done: nothing left that this layout could move
            sort_unhashed_free(self.pool)
        apply_moves(self.pool, moves)
        self.num_moves_total += len(moves)
        return moves

    def defragment(self, tables: Sequence[Sequence[KVCacheBlock]]) -> tuple[list[Move], DefragResult]:
        """A full defragmentation now (between steps: nothing is being written), as one
        batch of moves, already applied to the bookkeeping."""
        res = DefragResult(free_fragmentation_before=external_fragmentation(self.pool),
                           table_fragmentation_before=table_fragmentation(tables))
        res.fragmentation_before = max(res.free_fragmentation_before,
                                       res.table_fragmentation_before)
        target = target_layout(self.pool, tables)
        # An unbounded budget and nothing frozen: every chain shifts whole and every cycle
        # rotates whole, so one batch reaches the target layout.
        moves = select_moves(self.pool, target, len(target) + 1)
        apply_moves(self.pool, moves)
        sort_unhashed_free(self.pool)
        self.active = False
        self.num_moves_total += len(moves)
        res.num_moves = len(moves)
        res.free_fragmentation_after = external_fragmentation(self.pool)
        res.table_fragmentation_after = table_fragmentation(tables)
        res.fragmentation_after = max(res.free_fragmentation_after, res.table_fragmentation_after)
        self.last_fragmentation = res.fragmentation_after
        return moves, res



def written_blocks(req_to_blocks: dict[str, list[KVCacheBlock]], requests: dict,
                   scheduled: dict[str, int], block_size: int) -> set[int]:
    """Physical ids of the blocks this step writes: those holding the scheduled tokens of each
    request (``num_computed_tokens`` has not advanced yet when the scheduler asks)."""
    out: set[int] = set()
    for rid, n in scheduled.items():
        blocks = req_to_blocks[rid]
        first = requests[rid].num_computed_tokens // block_size
        last = (requests[rid].num_computed_tokens + n - 1) // block_size
        for i in range(first, min(last + 1, len(blocks))):
            out.add(blocks[i].block_id)
    return out
