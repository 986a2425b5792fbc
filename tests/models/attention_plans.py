"""What the attention tests share when they build a step's metadata by hand."""
from __future__ import annotations

import numpy as np
import torch

from llmtower.models.attention import AttentionMetadata, PrefillSeq


def add_prefills(meta: AttentionMetadata, tables: np.ndarray, start: np.ndarray,
                 end: np.ndarray, sched: np.ndarray, prefills: np.ndarray, row: int,
                 block_size: int) -> None:
    """Appends a ``PrefillSeq`` for each request in ``prefills`` (their rows follow from
    ``row`` on), with its blocks and causal mask when it has a cached context."""
    for i in prefills:
        s, e, q = int(start[i]), int(end[i]), int(sched[i])
        p = PrefillSeq(row, q, s)
        if s > 0:
            p.block_ids = torch.from_numpy(tables[i, :-(-e // block_size)].copy())
            p.mask = torch.from_numpy(np.arange(e)[None, :] <= (s + np.arange(q))[:, None])
        meta.prefills.append(p)
        row += q
