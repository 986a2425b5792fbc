"""The model runner's structured-output hook: apply the step's grammar bitmask to the logits
before sampling (disallowed tokens get -inf), as vLLM v1's runner does."""
from __future__ import annotations

from typing import Protocol

import numpy as np
import torch


class GrammarStep(Protocol):
    """What the hook reads of a step: the scheduler's ``SchedulerOutput`` provides it. A protocol
    rather than that class, because structured_output sits below core in the layers."""

    structured_output_request_ids: dict[str, int]  # request id -> row of grammar_bitmask
    grammar_bitmask: np.ndarray | None
    scheduled_spec_decode_tokens: dict[str, list[int]]


def grammar_logits_rows(so: GrammarStep, req_ids: list[str],
                        sample_mask: np.ndarray) -> tuple[list[int], list[int]]:
    """(logits rows, bitmask rows) of the constrained requests. The logits hold, for each
    sampled request in scheduler order, one row per draft token plus one."""
    rows = so.structured_output_request_ids
    drafts = so.scheduled_spec_decode_tokens
    logits_rows: list[int] = []
    mask_rows: list[int] = []
    r = 0
    for rid, sampled in zip(req_ids, sample_mask.tolist()):
        if not sampled:
            continue
        k = rows.get(rid)
        if k is not None:
            logits_rows.append(r)
            mask_rows.append(k)
        r += 1 + len(drafts.get(rid, ()))
    return logits_rows, mask_rows


def apply_grammar_bitmask(logits: torch.Tensor, so: GrammarStep, req_ids: list[str],
                          sample_mask: np.ndarray) -> None:
    """Mask, in place, the logits rows of the step's constrained requests."""
    logits_rows, mask_rows = grammar_logits_rows(so, req_ids, sample_mask)
    if not logits_rows:
        return
    import xgrammar  # the engine process has it loaded already (the manager uses it)

    bitmask = so.grammar_bitmask
    assert bitmask is not None
    vocab = logits.shape[-1]
    full = np.full((logits.shape[0], bitmask.shape[1]), -1, dtype=np.int32)
    full[logits_rows] = bitmask[mask_rows]
    target = logits if logits.dtype == torch.float32 else logits.float()
    xgrammar.apply_token_bitmask_inplace(target, torch.from_numpy(full), vocab_size=vocab,
                                         indices=logits_rows)
    if target is not logits:
        logits.copy_(target)
