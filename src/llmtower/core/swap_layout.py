"""The CPU swap space's layout: how many swap slots one swapped-out KV block takes, stored
as it is on the device or compressed to int8.

Without compression a slot is one block (the plain layout). When swap-outs may be compressed
(``--swap-space-dtype int8``, or ``--enable-degradation`` at level 2) the swap space mixes
blocks of two sizes in one pool of host memory, so it is cut into smaller slots: a block in
the cache's dtype takes ``slots_per_block`` slots, an int8 block (values plus the per-token,
per-head, per-32-channel scales of ``kernels/kv_quant.py``) ``slots_per_compressed_block``.
A block's slots need not be adjacent (the executor scatters its bytes over them), so the
free slots stay a stack, allocation is O(1) per slot and the swap space never fragments.

    float32 K/V, head_dim 64:  block 256 B per (token, head) row, int8 block 72 B
    slots_per_block 7 (a slot = 36.6 B per row), int8 block = 2 slots (73.1 B, 1.6% waste)
    -> the same host memory holds 3.5x the blocks compressed (the exact ratio is 3.56x)

The slot count is chosen once, from the byte sizes, as the smallest that wastes at most
``MAX_WASTE`` of a block of either kind: this keeps the (device block, slot) pairs short.
"""
from __future__ import annotations

from dataclasses import dataclass

MAX_WASTE = 0.03  # of a block, in padding, for either kind
MAX_SLOTS_PER_BLOCK = 16


@dataclass(frozen=True)
class SwapLayout:
    """Owns the slot geometry of the swap space: slots per block in the cache's dtype and per
    compressed block (0: compression is not available, the plain layout)."""

    slots_per_block: int = 1
    slots_per_compressed_block: int = 0

    @property
    def compressible(self) -> bool:
        return self.slots_per_compressed_block > 0

    def slots_for(self, compressed: bool) -> int:
        """Slots one swapped-out block takes."""
        if compressed:
            if not self.compressible:
                raise ValueError("this swap space has no compressed layout")
            return self.slots_per_compressed_block
        return self.slots_per_block

    def slot_bytes(self, block_bytes: int, compressed_block_bytes: int) -> int:
        """Bytes of one slot for blocks of these sizes (per layer): large enough for a block
        in k slots and a compressed one in c slots, a multiple of 8 (the executor copies
        slots as 8-byte words: byte-wise index copies are ~30x slower)."""
        size = -(-block_bytes // self.slots_per_block)
        if self.compressible:
            size = max(size, -(-compressed_block_bytes // self.slots_per_compressed_block))
        return -(-size // 8) * 8


PLAIN = SwapLayout()


def plan_swap_layout(block_bytes: int, compressed_block_bytes: int) -> SwapLayout:
    """The layout for a swap space holding both kinds of blocks: the smallest slot count per
    block whose padding wastes at most ``MAX_WASTE`` of either kind (else the least wasteful
    up to ``MAX_SLOTS_PER_BLOCK``). A compressed block no smaller than a plain one (an int8
    cache) gains nothing: the plain layout."""
    if compressed_block_bytes >= block_bytes:
        return PLAIN
    best: tuple[float, SwapLayout] | None = None
    for k in range(1, MAX_SLOTS_PER_BLOCK + 1):
        slot = -(-block_bytes // k)
        c = -(-compressed_block_bytes // slot)
        if c >= k:
            continue  # compression would save no slot
        waste = max(k * slot / block_bytes, c * slot / compressed_block_bytes) - 1.0
        if waste <= MAX_WASTE:
            return SwapLayout(k, c)
        if best is None or waste < best[0]:
            best = (waste, SwapLayout(k, c))
    return best[1] if best is not None else PLAIN
