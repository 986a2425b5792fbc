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
    changes, reused while it stays the same."""

    def __init__(self, adapters: list[LoRAAdapter], num_layers: int, dtype: torch.dtype) -> None:
        self.ids = tuple(a.int_id for a in adapters)
        self.dtype = dtype
        n = len(adapters)
        r = max(a.rank for a in adapters)
        self.groups: dict[str, _GroupStack] = {}
        for group, modules in GROUPS.items():
            targeted = [(k, m) for k, m in enumerate(modules) if any(m in a.a for a in adapters)]
            if not targeted:
                continue
            d_in = next(a.a[m].shape[2] for _, m in targeted for a in adapters if m in a.a)
            a_all = torch.zeros(num_layers, n, d_in, r * len(targeted), dtype=dtype)
            parts = []
            for j, (k, m) in enumerate(targeted):
                d_out = next(a.b[m].shape[1] for a in adapters if m in a.b)
                b_all = torch.zeros(num_layers, n, r, d_out, dtype=dtype)
                for s, ad in enumerate(adapters):
                    if m in ad.a:  # [L, rank, in] -> [L, in, rank]; [L, out, rank] -> [L, rank, out]
                        a_all[:, s, :, j * r:j * r + ad.rank] = ad.a[m].transpose(1, 2)
                        b_all[:, s, :ad.rank, :] = ad.b[m].transpose(1, 2)
                parts.append(_Part(k, slice(j * r, (j + 1) * r),
                                   [b_all[i].contiguous() for i in range(num_layers)]))
            self.groups[group] = _GroupStack([a_all[i].contiguous() for i in range(num_layers)],
                                             parts)


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
