"""A CPU swap space cut into slots, holding swapped-out KV blocks either as they are in the
cache or compressed to int8 (``core/swap_layout.py`` says how many slots each takes).

    arenas[layer] : int64 [num_slots, slot_bytes / 8]   (bytes, copied as 8-byte words)

A swapped block of one layer is its K and V rows, ``[2, block_size, kv_heads, width]``, laid
out as bytes and cut into its slots in the order the scheduler listed them; the slots need not
be adjacent. Compressed, those rows are ``kv_quant.quantize``'d first (int8 values and a
float32 scale per token, KV head and 32 channels, exactly the layout of an int8 KV cache),
and ``dequantize``'d back into the cache's dtype on the way in: the only lossy step.
Uncompressed, the bytes travel unchanged, so a swap round trip is exact.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from llmtower.core.swap_layout import PLAIN, SwapLayout, plan_swap_layout
from llmtower.kernels.kv_quant import bytes_per_token_head, dequantize, quantize, row_width
from llmtower.models.config import ModelConfig

Pairs = list[tuple[int, int]]


class SlotSwapSpace:
    """Owns the host memory of a slotted swap space (one byte arena per layer) and copies
    blocks between it and the device KV cache, quantizing the compressed ones."""

    def __init__(self, layout: SwapLayout, num_slots: int, num_layers: int, block_size: int,
                 num_kv_heads: int, head_dim: int, cache_dtype: torch.dtype) -> None:
        if cache_dtype == torch.int8:
            raise ValueError("an int8 KV cache is swapped as it is: it needs no slotted swap space")
        self.layout = layout
        self.head_dim = head_dim
        self.row_shape = (2, block_size, num_kv_heads)
        esize = torch.empty((), dtype=cache_dtype).element_size()
        self.block_bytes = 2 * block_size * num_kv_heads * head_dim * esize
        self.compressed_block_bytes = 2 * block_size * num_kv_heads * row_width(head_dim,
                                                                              torch.int8)
        self.slot_bytes = layout.slot_bytes(self.block_bytes, self.compressed_block_bytes)
        self.num_slots = num_slots
        # Only read after written: uninitialized memory is fine.
        self.arenas = [torch.empty((num_slots, self.slot_bytes // 8), dtype=torch.int64)
                       for _ in range(num_layers)]

    # ------------------------------------------------------------------ the two directions
    def swap_out(self, caches: list[torch.Tensor], pairs: Pairs, compressed: list[int]) -> None:
        """(device block, slot) pairs; the device blocks in ``compressed`` are stored int8."""
        for devs, slots, comp in self._groups(pairs, compressed, device_first=True):
            self._write(caches, devs, slots, comp)

    def swap_in(self, caches: list[torch.Tensor], pairs: Pairs, compressed: list[int]) -> None:
        """(slot, device block) pairs; the device blocks in ``compressed`` arrive from int8."""
        for devs, slots, comp in self._groups(pairs, compressed, device_first=False):
            self._read(caches, devs, slots, comp)

    # ------------------------------------------------------------------ helpers
    def _groups(self, pairs: Pairs, compressed: list[int], device_first: bool
                ) -> list[tuple[list[int], list[int], bool]]:
        """Split the pairs into (device blocks, their slots, compressed) for both kinds,
        checking that each block got exactly its number of consecutive slots."""
        comp_ids = set(compressed)  # membership only
        out: list[tuple[list[int], list[int], bool]] = []
        by_device = pairs if device_first else [(d, s) for s, d in pairs]
        for comp in (False, True):
            sel = [p for p in by_device if (p[0] in comp_ids) == comp]
            if not sel:
                continue
            per = self.layout.slots_for(comp)
            devs = [d for d, _ in sel[::per]]
            if len(sel) != len(devs) * per or any(sel[i][0] != devs[i // per]
                                                  for i in range(len(sel))):
                raise ValueError(f"swap pairs do not give each {'compressed ' if comp else ''}"
                                 f"block its {per} consecutive slot(s): {sel[:2 * per]}...")
            out.append((devs, [s for _, s in sel], comp))
        return out

    def _write(self, caches: list[torch.Tensor], devs: list[int], slots: list[int],
               comp: bool) -> None:
        n, per = len(devs), self.layout.slots_for(comp)
        dev_idx = torch.tensor(devs, dtype=torch.long)
        slot_idx = torch.tensor(slots, dtype=torch.long)
        for cache, arena in zip(caches, self.arenas):
            x = cache.index_select(1, dev_idx)  # [2, n, bs, hkv, D]
            if comp:
                x = quantize(x)  # [2, n, bs, hkv, D + scales] int8
            # (reshape(-1): a flat dense copy, whose bytes may be viewed whatever the strides)
            rows = x.transpose(0, 1).reshape(-1).view(torch.uint8).view(n, -1)
            rows = F.pad(rows, (0, per * self.slot_bytes - rows.shape[1]))
            arena.index_copy_(0, slot_idx, rows.view(torch.int64).view(n * per, -1))

    def _read(self, caches: list[torch.Tensor], devs: list[int], slots: list[int],
              comp: bool) -> None:
        n = len(devs)
        dev_idx = torch.tensor(devs, dtype=torch.long)
        slot_idx = torch.tensor(slots, dtype=torch.long)
        nbytes = self.compressed_block_bytes if comp else self.block_bytes
        for cache, arena in zip(caches, self.arenas):
            raw = arena.index_select(0, slot_idx).view(torch.uint8).view(n, -1)[:, :nbytes]
            if comp:
                q = raw.reshape(-1).view(torch.int8).view(n, *self.row_shape, -1)
                x = dequantize(q.transpose(0, 1), cache.dtype, self.head_dim)
            else:
                x = raw.reshape(-1).view(cache.dtype).view(n, *self.row_shape, -1).transpose(0, 1)
            cache.index_copy_(1, dev_idx, x)


def block_bytes_per_layer(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """One layer's K and V of one block stored in ``kv_dtype`` (int8: with its scales)."""
    return (2 * block_size * config.num_key_value_heads
            * bytes_per_token_head(config.head_dim, kv_dtype))


def swap_layout_for(config: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                    may_compress: bool) -> SwapLayout:
    """The swap space's layout: plain unless swap-outs may be compressed (and compressing
    saves memory: never for an int8 cache)."""
    if not may_compress:
        return PLAIN
    return plan_swap_layout(block_bytes_per_layer(config, block_size, kv_dtype),
                            block_bytes_per_layer(config, block_size, torch.int8))


def swap_slot_bytes(config: ModelConfig, block_size: int, kv_dtype: torch.dtype,
                    layout: SwapLayout) -> int:
    """Host memory of one swap slot across all layers (what ``--swap-space`` is cut into)."""
    per_layer = layout.slot_bytes(block_bytes_per_layer(config, block_size, kv_dtype),
                                  block_bytes_per_layer(config, block_size, torch.int8))
    return config.num_hidden_layers * per_layer
