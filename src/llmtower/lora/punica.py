"""The step's batched low-rank product (vLLM's punica "shrink then expand", on CPU).

The base product runs once over all rows; then, per fused product, the rows that carry an
adapter add ``(x @ A.T) @ B.T`` of their own adapter. The active adapters' A matrices are
stacked into one matrix per layer (columns grouped by projection, then by adapter), so that
one GEMM shrinks every LoRA row against every active adapter; a 0/1 mask keeps each row's own
adapter's columns; one GEMM per projection expands them. Two GEMMs per product whatever the
number of adapters, where a loop per adapter would make hundreds of small calls a step; the
extra multiply-adds (rows x other adapters' ranks) are small next to the base product's at
the ranks LoRA uses. Rows without an adapter are left out of both GEMMs, and a step with no
adapter rows never reaches this module.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from llmtower.lora.adapter import GROUPS, LoRAAdapter


@dataclass
class _Part:
    """One projection of a fused product: its output's index among the group's outputs, its
    columns in the stacked A, and its B per layer [out, columns] (scaled)."""

    out_index: int
    cols: slice
    b: list[torch.Tensor]


@dataclass
class _GroupStack:
    """The active adapters' matrices for one fused product (e.g. q/k/v): ``a`` per layer
    [columns, in]; ``col_slot`` [columns]: which active adapter owns each column."""

    a: list[torch.Tensor]
    parts: list[_Part]
    col_slot: torch.Tensor


class StackedLoRA:
    """Owns the stacked matrices of one set of active adapters (slot i = ``adapters[i]``);
    built when the step's set of adapters changes, reused while it stays the same."""

    def __init__(self, adapters: list[LoRAAdapter], num_layers: int, dtype: torch.dtype) -> None:
        self.ids = tuple(a.int_id for a in adapters)
        self.dtype = dtype
        self.groups: dict[str, _GroupStack] = {}
        for group, modules in GROUPS.items():
            a_cols: list[torch.Tensor] = []  # [L, r, in] blocks in column order
            slots: list[int] = []
            parts: list[_Part] = []
            col = 0
            for k, module in enumerate(modules):
                users = [(s, ad) for s, ad in enumerate(adapters) if module in ad.a]
                if not users:
                    continue
                start = col
                for s, ad in users:
                    a_cols.append(ad.a[module])
                    slots += [s] * ad.rank
                    col += ad.rank
                b = torch.cat([ad.b[module] for _, ad in users], dim=2)  # [L, out, cols]
                parts.append(_Part(k, slice(start, col), [b[i].contiguous()
                                                          for i in range(num_layers)]))
            if not parts:
                continue
            a = torch.cat(a_cols, dim=1)  # [L, columns, in]
            self.groups[group] = _GroupStack([a[i].contiguous() for i in range(num_layers)],
                                             parts, torch.tensor(slots, dtype=torch.int64))


class LoRAStep:
    """One step's rows and their adapters: ``row_slot`` [rows] is each row's slot in
    ``stack`` (-1: no adapter). ``add`` adds the rows' low-rank products to a fused product's
    outputs; ``select`` follows the model when it keeps only the sampled rows."""

    def __init__(self, stack: StackedLoRA, row_slot: torch.Tensor) -> None:
        self.stack = stack
        self.row_slot = row_slot
        has = row_slot >= 0
        self.num_rows = int(has.sum())
        # None: every row has an adapter (no gather or scatter).
        self.rows = None if self.num_rows == row_slot.shape[0] else torch.nonzero(has).view(-1)
        slots = row_slot if self.rows is None else row_slot.index_select(0, self.rows)
        single = len(stack.ids) == 1  # every LoRA row's columns are all the columns
        self.masks: dict[str, torch.Tensor | None] = {
            g: None if single else (slots[:, None] == gs.col_slot[None, :]).to(stack.dtype)
            for g, gs in stack.groups.items()}

    def targets(self, group: str) -> bool:
        """Whether some row of this step has an adapter on ``group`` (a key of GROUPS)."""
        return self.num_rows > 0 and group in self.stack.groups

    def select(self, index: torch.Tensor) -> LoRAStep:
        return LoRAStep(self.stack, self.row_slot.index_select(0, index))

    def add(self, layer: int, group: str, x: torch.Tensor, *outs: torch.Tensor) -> None:
        """``outs[k] += `` the LoRA rows' product for the group's k-th projection (in place;
        views of a fused output are fine), ``x`` [rows, in] being the product's input."""
        gs = self.stack.groups.get(group)
        if gs is None or self.num_rows == 0:
            return
        rows = self.rows
        xs = x if rows is None else x.index_select(0, rows)
        s = F.linear(xs, gs.a[layer])
        mask = self.masks[group]
        if mask is not None:
            s.mul_(mask)
        for part in gs.parts:
            delta = F.linear(s[:, part.cols], part.b[layer])
            out = outs[part.out_index]
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
