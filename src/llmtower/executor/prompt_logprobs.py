"""Prompt logprobs (``SamplingParams.prompt_logprobs``): the log-probability the model gave each
prompt token after the tokens before it, with the top alternatives.

They come out of the prefill at no extra forward pass: the flat rows of a prompt chunk are
added to the rows the model turns into logits (``logits_indices``), after the rows that are
sampled, and split off again here. Row ``p`` of a prompt predicts its token ``p + 1``, so a
chunk ``[start, end)`` yields the entries of tokens ``start + 1 .. end`` (never beyond the
prompt). A request keeps its InputBatch row across preemptions; ``next_position`` there makes
a recomputed chunk add nothing twice. The scheduler keeps such prompts out of the prefix cache
(a cached block would have no logits).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmtower.core.outputs import LogprobsEntry
from llmtower.executor.input_batch import InputBatch


@dataclass
class PromptLogprobsPlan:
    """Which extra flat rows become logits this step, and whose prompt tokens they score."""

    flat_rows: torch.Tensor  # [P] rows of the flat batch, in request order
    targets: torch.Tensor  # [P] the prompt token each row predicts
    req_ids: list[str]  # one per request with rows here
    counts: list[int]  # rows of each of those requests, in order
    num_top: list[int]  # top alternatives each wants


def plan_prompt_logprobs(batch: InputBatch, req_ids: list[str], rows: np.ndarray,
                         start: np.ndarray, end: np.ndarray, flat_first: np.ndarray
                         ) -> PromptLogprobsPlan | None:
    """The plan of one step, or None when no scheduled request wants prompt logprobs (the
    common case costs one vectorized test)."""
    wants = batch.num_prompt_logprobs[rows] >= 0
    if not wants.any():
        return None
    flat: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    plan_ids, counts, num_top = [], [], []
    for i in np.flatnonzero(wants):
        row = int(rows[i])
        first_pos = max(int(start[i]), int(batch.prompt_logprobs_next[row]))
        # Position p predicts token p + 1, which must still be a prompt token.
        last_pos = min(int(end[i]), int(batch.num_prompt_tokens[row]) - 1)
        if last_pos <= first_pos:
            continue
        positions = np.arange(first_pos, last_pos)
        flat.append(flat_first[i] + positions - int(start[i]))
        targets.append(batch.token_ids[row, first_pos + 1:last_pos + 1].astype(np.int64))
        batch.prompt_logprobs_next[row] = last_pos
        plan_ids.append(req_ids[i])
        counts.append(last_pos - first_pos)
        num_top.append(int(batch.num_prompt_logprobs[row]))
    if not plan_ids:
        return None
    return PromptLogprobsPlan(torch.from_numpy(np.concatenate(flat)),
                              torch.from_numpy(np.concatenate(targets)), plan_ids, counts,
                              num_top)


def compute_prompt_logprobs(logits: torch.Tensor, plan: PromptLogprobsPlan
                            ) -> dict[str, list[LogprobsEntry]]:
    """logits [P, vocab] of the plan's rows -> per request, one entry per scored prompt
    token: its logprob, its rank, and the top ``num_top`` alternatives."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, plan.targets.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen_list = chosen.squeeze(1).tolist()
    targets = plan.targets.tolist()
    max_top = max(plan.num_top)
    top_v, top_i = (lp.topk(max_top, dim=-1) if max_top else (None, None))
    top_vals = top_v.tolist() if top_v is not None else None
    top_ids = top_i.tolist() if top_i is not None else None
    out: dict[str, list[LogprobsEntry]] = {}
    j = 0
    for rid, count, k in zip(plan.req_ids, plan.counts, plan.num_top):
        entries = []
        for r in range(j, j + count):
            top = (list(zip(top_ids[r][:k], top_vals[r][:k]))
                   if k and top_ids is not None and top_vals is not None else [])
            entries.append(LogprobsEntry(targets[r], chosen_list[r], ranks[r], top))
        out[rid] = entries
        j += count
    return out
