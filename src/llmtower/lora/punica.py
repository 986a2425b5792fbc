"""The step's batched low-rank product (vLLM's punica "shrink then expand", on CPU).

The base product runs once over all rows; then, per fused product, the rows that carry an
adapter add ``(x @ A.T) @ B.T`` of their own adapter. The step's adapter rows are gathered
into one padded block per adapter ([adapters, rows of the busiest one, in]) and every
adapter's product runs in one batched GEMM (``torch.bmm``): a shrink per fused product (the
q, k and v matrices of an adapter side by side) and an expand per projection, then one
scatter-add back to the rows. A few calls per product whatever the number of adapters, each
row multiplied by its own adapter only (no work spent on others' ranks), where a loop over
adapters would make hundreds of small calls a step. Rows without an adapter are never
gathered, and a step with no adapter rows never reaches this module. Where padding would
more than double the work (a prefill chunk of one adapter beside single decode rows of
others), each adapter's rows run as their own pair of GEMMs instead (the segmented form).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmtower.kernels.decode_layer_lora import LoRAProducts, LoRARows
from llmtower.lora.adapter import GROUPS, LoRAAdapter


# Most padded rows per adapter row before a step takes the segmented form.
PADDING_LIMIT = 2


@dataclass
class _Part:
    """One projection of a fused product: its output's index among the group's outputs, its
    columns in the shrink's output, and per layer B [adapters, rank, out] (scaled)."""

    out_index: int
    cols: slice
    b: list[torch.Tensor]


@dataclass
class _GroupStack:
    """The active adapters' matrices for one fused product (e.g. q/k/v): per layer A
    [adapters, in, columns], the columns of each targeted projection side by side."""

    a: list[torch.Tensor]
    parts: list[_Part]


class StackedLoRA:
    """Owns the stacked matrices of one set of active adapters (slot i = ``adapters[i]``),
    each zero-padded to the set's highest rank; built when the step's set of adapters
    changes, reused while it stays the same. Per fused product that some adapter targets,
    every projection of it is stacked (zeros where an adapter leaves one alone), in the layout
    the fused C decode layer reads (``kernels/decode_layer.py`` LoRAProducts): ``a[group]``
    [layers, adapters, projections * rank, in] and ``b[group]`` [layers, adapters, each
    projection's B.T [rank, out] flattened one after the other]; ``groups`` holds the views
    the batched torch product takes of them."""

    def __init__(self, adapters: list[LoRAAdapter], num_layers: int, dtype: torch.dtype,
                 dims: dict[str, tuple[int, int]] | None = None) -> None:
        self.ids = tuple(a.int_id for a in adapters)
        self.dtype = dtype
        self.num_layers = num_layers
        n = len(adapters)
        self.rank = r = max(a.rank for a in adapters)
        self.groups: dict[str, _GroupStack] = {}
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.out_sizes: dict[str, list[int]] = {}
        self._decode: LoRAProducts | None = None
        for group, modules in GROUPS.items():
            if not any(m in a.a for m in modules for a in adapters):
                continue
            d_in = next(a.a[m].shape[2] for m in modules for a in adapters if m in a.a)
            sizes = [self._out_size(adapters, m, dims) for m in modules]
            a_all = torch.zeros(num_layers, n, r * len(modules), d_in, dtype=dtype)
            b_all = torch.zeros(num_layers, n, r * sum(sizes), dtype=dtype)
            parts = []
            off = 0
            for j, (m, d_out) in enumerate(zip(modules, sizes)):
                b_view = b_all[:, :, off:off + r * d_out].view(num_layers, n, r, d_out)
                for s, ad in enumerate(adapters):
                    if m in ad.a:  # A [L, rank, in] as it is; B [L, out, rank] -> [L, rank, out]
                        a_all[:, s, j * r:j * r + ad.rank] = ad.a[m]
                        b_view[:, s, :ad.rank] = ad.b[m].transpose(1, 2)
                parts.append(_Part(j, slice(j * r, (j + 1) * r),
                                   [b_view[i] for i in range(num_layers)]))
                off += r * d_out
            self.a[group], self.b[group], self.out_sizes[group] = a_all, b_all, sizes
            self.groups[group] = _GroupStack([a_all[i].transpose(1, 2) for i in range(num_layers)],
                                             parts)

    def decode_products(self) -> LoRAProducts:
        """The fused C decode layer's description of these matrices (float32; built once)."""
        if self._decode is None:
            self._decode = LoRAProducts(self.num_layers, len(self.ids), self.rank,
                                        {g: (self.a[g], self.b[g], self.out_sizes[g])
                                         for g in self.groups})
        return self._decode

    @staticmethod
    def _out_size(adapters: list[LoRAAdapter], module: str,
                  dims: dict[str, tuple[int, int]] | None) -> int:
        """A projection's output size: from an adapter that targets it, else the model's
        ``dims`` (module -> (in, out))."""
        size = next((a.b[module].shape[1] for a in adapters if module in a.b), None)
        if size is None:
            if dims is None:
                raise ValueError(f"no adapter of the set targets {module}: its size must "
                                 "come with the model's dims")
            size = dims[module][1]
        return size


class LoRAStep:
    """One step's rows and their adapters: ``row_slot`` [rows] is each row's slot in
    ``stack`` (-1: no adapter). ``add`` adds the rows' low-rank products to a fused product's
    outputs; ``select`` follows the model when it keeps only the sampled rows."""

    def __init__(self, stack: StackedLoRA, row_slot: np.ndarray) -> None:
        self.stack = stack
        self.row_slot = row_slot
        rows = np.flatnonzero(row_slot >= 0)
        self.num_rows = len(rows)
        n = len(stack.ids)
        # The padded layout: adapter s's rows in gather[s, :count[s]], the rest row 0 (their
        # shrink is zeroed by ``valid``, so they add nothing to row 0).
        slots = row_slot[rows]
        order = np.argsort(slots, kind="stable")
        rows, slots = rows[order], slots[order]
        counts = np.bincount(slots, minlength=n)
        m = int(counts.max()) if self.num_rows else 0
        starts = np.cumsum(counts) - counts
        within = np.arange(self.num_rows) - starts[slots]
        gather = np.zeros((n, m), dtype=np.int64)
        gather[slots, within] = rows
        valid = np.zeros((n, m, 1), dtype=np.float32)
        valid[slots, within] = 1.0
        self.m = m
        self.gather = torch.from_numpy(gather.reshape(-1))
        self.padded = self.num_rows < n * m
        self.valid = torch.from_numpy(valid).to(stack.dtype)
        # (slot, its rows) per adapter with rows, where padding would waste more than it saves.
        self.segments: list[tuple[int, torch.Tensor]] | None = None
        if n * m > PADDING_LIMIT * self.num_rows:
            self.segments = [(s, torch.from_numpy(rows[starts[s]:starts[s] + counts[s]]))
                             for s in range(n) if counts[s]]

    def decode_rows(self) -> LoRARows:
        """These rows as the fused C decode layer reads them (float32 stacks)."""
        return self.stack.decode_products().rows(
            torch.from_numpy(np.ascontiguousarray(self.row_slot, dtype=np.int64)))

    def targets(self, group: str) -> bool:
        """Whether some row of this step has an adapter on ``group`` (a key of GROUPS)."""
        return self.num_rows > 0 and group in self.stack.groups

    def select(self, index: torch.Tensor) -> LoRAStep:
        return LoRAStep(self.stack, self.row_slot[index.numpy()])

    def add(self, layer: int, group: str, x: torch.Tensor, *outs: torch.Tensor) -> None:
        """``outs[k] += `` the LoRA rows' product for the group's k-th projection (in place;
        views of a fused output are fine), ``x`` [rows, in] being the product's input."""
        gs = self.stack.groups.get(group)
        if gs is None or self.num_rows == 0:
            return
        if self.segments is not None:
            for slot, rows in self.segments:
                s = x.index_select(0, rows) @ gs.a[layer][slot]
                for part in gs.parts:
                    outs[part.out_index].index_add_(0, rows, s[:, part.cols] @ part.b[layer][slot])
            return
        n = len(self.stack.ids)
        xs = x.index_select(0, self.gather).view(n, self.m, x.shape[1])
        s = torch.bmm(xs, gs.a[layer])  # [n, m, columns]
        if self.padded:
            s.mul_(self.valid)
        for part in gs.parts:
            delta = torch.bmm(s[:, :, part.cols], part.b[layer])  # [n, m, out]
            outs[part.out_index].index_add_(0, self.gather, delta.view(n * self.m, -1))
