"""The paged KV cache tensors and their CPU swap space.

  one tensor per layer, indexed by the physical block ids the scheduler hands out:

      kv_caches[layer] : [2, num_blocks, block_size, num_kv_heads, head_dim]
                          │   │           │           └─ one token's K (or V) for all heads:
                          │   │           │              num_kv_heads * head_dim contiguous values
                          │   │           └─ slot within the block (position p -> p % block_size)
                          │   └─ physical block id (block_table[p // block_size])
                          └─ 0: keys, 1: values

  swap_caches[layer] : the same layout with num_cpu_blocks blocks ("CPU" swap space; on a
                       CPU-only machine simply a second pool of memory the scheduler manages)
                       -- or, where swap-outs may be compressed to int8, a ``SlotSwapSpace``
                       (``swap_space.py``): num_cpu_blocks slots, several per block

A whole block of one layer's K (or V) is contiguous, so block swaps and copies, and the
attention's per-request gathers, move whole blocks with one ``index_select``/``index_copy_``.
"""
from __future__ import annotations

import torch

from llmtower.core.swap_layout import PLAIN, SwapLayout
from llmtower.kernels.kv_quant import bytes_per_token_head, row_width
from llmtower.executor.swap_space import SlotSwapSpace
from llmtower.kernels.huge_pages import empty_on_huge_pages
from llmtower.models.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Memory of one KV block across all layers (K and V) stored in ``dtype`` (int8: with its
    per-row scales, ``kv_quant.py``)."""
    return (2 * config.num_hidden_layers * block_size * config.num_key_value_heads
            * bytes_per_token_head(config.head_dim, dtype))


class KVCache:
    """Owns the device KV tensors (one per layer) and the swap tensors, and performs the block
    swaps and copies listed in a ``SchedulerOutput``."""

    def __init__(self, config: ModelConfig, num_blocks: int, num_cpu_blocks: int,
                 block_size: int, dtype: torch.dtype, kv_dtype: torch.dtype | None = None,
                 swap_layout: SwapLayout = PLAIN) -> None:
        # kv_dtype (--kv-cache-dtype): the storage dtype, default the model's; int8 packs a
        # scale behind every row (kv_quant.py), so swaps and moves copy the scales too.
        kv_dtype = dtype if kv_dtype is None else kv_dtype
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks}: the KV cache needs at least one block; "
                             "give it more memory (--kv-cache-memory) or set --num-gpu-blocks")
        shape = (2, num_blocks, block_size, config.num_key_value_heads,
                 row_width(config.head_dim, kv_dtype))
        # Zeroed, not empty: attention reads padding slots (masked out) and they must hold
        # finite numbers, since 0 * NaN would poison the weighted sum of values.
        self.kv_caches = [empty_on_huge_pages(shape, kv_dtype).zero_()
                          for _ in range(config.num_hidden_layers)]
        cpu_shape = (2, num_cpu_blocks) + shape[2:]
        # Swap blocks are only read after they were written, so they may start uninitialized.
        # A layout with compressed blocks cuts the swap space into slots instead.
        self.swap_space: SlotSwapSpace | None = None
        self.swap_caches: list[torch.Tensor] = []
        if num_cpu_blocks and swap_layout != PLAIN:
            self.swap_space = SlotSwapSpace(swap_layout, num_cpu_blocks, config.num_hidden_layers,
                                            block_size, config.num_key_value_heads,
                                            config.head_dim, kv_dtype)
        elif num_cpu_blocks:
            self.swap_caches = [torch.empty(cpu_shape, dtype=kv_dtype)
                                for _ in range(config.num_hidden_layers)]
        self.num_blocks = num_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.swap_layout = swap_layout
        self.block_size = block_size
        self.kv_dtype = kv_dtype

    def swap_out(self, pairs: list[tuple[int, int]], compressed: list[int] | None = None
                 ) -> None:
        """(device block, CPU slot) pairs: copy device blocks into swap space (those listed
        in ``compressed`` quantized to int8)."""
        if self.swap_space is not None:
            if pairs:
                self.swap_space.swap_out(self.kv_caches, pairs, compressed or [])
            return
        self._check_plain(compressed)
        self._move(pairs, self.kv_caches, self.swap_caches, "swap_out")

    def swap_in(self, pairs: list[tuple[int, int]], compressed: list[int] | None = None
                ) -> None:
        """(CPU slot, device block) pairs: copy swapped blocks back to the device (those
        listed in ``compressed`` dequantized from int8)."""
        if self.swap_space is not None:
            if pairs:
                self.swap_space.swap_in(self.kv_caches, pairs, compressed or [])
            return
        self._check_plain(compressed)
        self._move(pairs, self.swap_caches, self.kv_caches, "swap_in")

    @staticmethod
    def _check_plain(compressed: list[int] | None) -> None:
        if compressed:
            raise RuntimeError("the scheduler asked for compressed swaps but this KV cache's "
                               "swap space has the plain layout (no int8 slots)")

    def move(self, pairs: list[tuple[int, int]]) -> None:
        """(src, dst) device block pairs of the relocator, one gather-then-scatter batch (a
        batch may rotate blocks along a cycle)."""
        self._move(pairs, self.kv_caches, self.kv_caches, "move")

    @staticmethod
    def _move(pairs: list[tuple[int, int]], src_caches: list[torch.Tensor],
              dst_caches: list[torch.Tensor], what: str) -> None:
        if not pairs:
            return
        if not src_caches or not dst_caches:
            raise RuntimeError(f"the scheduler asked for {what} of {len(pairs)} block(s) but the "
                               "executor has no swap space: set --swap-space above 0")
        idx = torch.tensor(pairs, dtype=torch.long)
        src, dst = idx[:, 0], idx[:, 1]
        for s, d in zip(src_caches, dst_caches):
            # Gather first, then scatter: also right when a pair's source is another's target.
            d.index_copy_(1, dst, s.index_select(1, src))
