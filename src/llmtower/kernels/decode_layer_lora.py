"""The LoRA hooks of the fused decode layer (``decode_layer.c``), Python side: one set of
active adapters' stacked float32 matrices described for the C code (``LoRAProducts``, per layer
and fused product) and one step's adapter rows grouped by adapter slot with their shrink /
expand buffers (``LoRARows``). ``lora/punica.py`` builds the stacks; ``DecodeLayers`` passes
a step's ``LoRARows`` to ``begin_step``."""
from __future__ import annotations

import ctypes

import torch

_P = ctypes.c_void_p


class LoraProduct(ctypes.Structure):
    """One fused product's LoRA matrices in one layer for a set of adapters (see
    decode_layer.c): A [slots, parts * r, k], B.T per slot and part [r, part's columns]."""

    _fields_ = [("a", _P), ("b", _P), ("nparts", ctypes.c_int64), ("r", ctypes.c_int64),
                ("cols", ctypes.c_int64 * 4)]


class LoraRows(ctypes.Structure):
    """A step's adapter rows grouped by slot, each row's place among them, work buffers."""

    _fields_ = [("products", _P), ("rows", _P), ("starts", _P), ("index", _P),
                ("slots", ctypes.c_int64), ("s", _P), ("d", _P), ("ld_s", ctypes.c_int64),
                ("ld_d", ctypes.c_int64)]


# The fused products a layer's LoRA hooks follow, in decode_layer.c's order (LORA_QKV ..).
LORA_PRODUCTS = ("qkv", "o", "gate_up", "down")


class LoRAProducts:
    """Owns the C description (``LoraProduct`` per layer and fused product) of one set of
    active adapters' float32 matrices, stacked by ``lora/punica.py``'s StackedLoRA: per
    targeted product ``a`` [layers, slots, parts * rank, in], ``b`` [layers, slots, each
    part's B.T [rank, out] flattened in turn] and the parts' output sizes."""

    def __init__(self, num_layers: int, slots: int, rank: int,
                 groups: dict[str, tuple[torch.Tensor, torch.Tensor, list[int]]]) -> None:
        self.num_layers, self.slots, self.rank = num_layers, slots, rank
        self._keep = groups
        self._array = (LoraProduct * (num_layers * len(LORA_PRODUCTS)))()
        self.shapes: dict[str, tuple[int, list[int]]] = {}
        self.ld_s = self.ld_d = 1
        for group, (a, b, sizes) in groups.items():
            which = LORA_PRODUCTS.index(group)
            k = a.shape[-1]
            rr, n = rank * len(sizes), sum(sizes)
            if a.dtype != torch.float32 or b.dtype != torch.float32 or not a.is_contiguous() \
                    or not b.is_contiguous() or tuple(a.shape) != (num_layers, slots, rr, k) \
                    or tuple(b.shape) != (num_layers, slots, rank * n) or len(sizes) > 3:
                raise ValueError(f"LoRA {group}: A must be contiguous float32 "
                                 f"[{num_layers}, {slots}, {rr}, in], B [{num_layers}, {slots}, "
                                 f"{rank * n}], at most 3 parts")
            cols = [0]
            for size in sizes:
                cols.append(cols[-1] + size)
            cols += [n] * (4 - len(cols))
            for layer in range(num_layers):
                self._array[layer * len(LORA_PRODUCTS) + which] = LoraProduct(
                    a[layer].data_ptr(), b[layer].data_ptr(), len(sizes), rank,
                    (ctypes.c_int64 * 4)(*cols))
            self.shapes[group] = (k, list(sizes))
            self.ld_s, self.ld_d = max(self.ld_s, rr), max(self.ld_d, n)
        self.ptr = ctypes.addressof(self._array)

    def rows(self, row_slot: torch.Tensor) -> LoRARows:
        """The C view of a step's rows: ``row_slot`` [rows] int64, each row's slot (-1: none)."""
        return LoRARows(self, row_slot)


class LoRARows:
    """Owns one step's (or its sampled rows') ``LoraRows``: the rows with an adapter grouped
    by slot, each row's place among them, and the shrink / expand buffers."""

    def __init__(self, products: LoRAProducts, row_slot: torch.Tensor) -> None:
        self.products = products
        self.row_slot = row_slot
        self.num_rows = row_slot.shape[0]
        rows = torch.nonzero(row_slot >= 0).flatten()
        slots = row_slot[rows]
        slots, order = torch.sort(slots, stable=True)
        self._rows = rows[order].contiguous()
        counts = torch.bincount(slots, minlength=products.slots)
        self._starts = torch.zeros(products.slots + 1, dtype=torch.int64)
        torch.cumsum(counts, 0, out=self._starts[1:])
        self._index = torch.full((self.num_rows,), -1, dtype=torch.int64)
        self._index[self._rows] = torch.arange(len(self._rows))
        count = max(len(self._rows), 1)
        self._s = torch.empty(count, products.ld_s)
        self._d = torch.empty(count, products.ld_d)
        self._c = LoraRows(products.ptr, self._rows.data_ptr(), self._starts.data_ptr(),
                           self._index.data_ptr(), products.slots, self._s.data_ptr(),
                           self._d.data_ptr(), products.ld_s, products.ld_d)
        self.ptr = ctypes.addressof(self._c)

    def select(self, rows: torch.Tensor) -> LoRARows:
        """The rows ``rows`` of this step, in that order (the sampled rows)."""
        return LoRARows(self.products, self.row_slot[rows])
