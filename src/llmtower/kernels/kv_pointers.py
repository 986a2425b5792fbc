"""The K and V base pointers of every layer's paged KV cache, as the fused decode layers'
C calls take them: two ctypes arrays built once and kept while the caches stay where they are
(a relocation or a new cache builds them again)."""
from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch


class KVPointers:
    """Owns the last checked set of KV caches (by their addresses), their K and V pointer
    arrays and their block count and size. ``what`` names the caller in its errors."""

    def __init__(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype, what: str) -> None:
        self.nkv, self.d, self.dtype, self.what = num_kv_heads, head_dim, dtype, what
        self._key: tuple[int, ...] = ()
        self._ptrs = (ctypes.c_void_p * 0)(), (ctypes.c_void_p * 0)()
        self.num_blocks = self.block_size = 0

    def get(self, kv_caches: Sequence[torch.Tensor]) -> tuple[ctypes.Array, ctypes.Array]:
        """(K pointers, V pointers), one per layer; checks a new set of caches' layout."""
        key = tuple(c.data_ptr() for c in kv_caches)
        if key != self._key:
            shape = tuple(kv_caches[0].shape)
            if len(shape) != 5 or shape[0] != 2 or shape[3:] != (self.nkv, self.d) or any(
                    tuple(c.shape) != shape or c.dtype != self.dtype or not c.is_contiguous()
                    for c in kv_caches):
                raise ValueError(f"{self.what}: every KV cache must be contiguous {self.dtype} "
                                 f"[2, blocks, block_size, {self.nkv}, {self.d}], all of one "
                                 "shape")
            self.num_blocks, self.block_size = shape[1], shape[2]
            n = len(kv_caches)
            k = (ctypes.c_void_p * n)(*(c.data_ptr() for c in kv_caches))
            v = (ctypes.c_void_p * n)(*(c.data_ptr() + c.stride(0) * c.element_size()
                                        for c in kv_caches))
            self._key, self._ptrs = key, (k, v)
        return self._ptrs
