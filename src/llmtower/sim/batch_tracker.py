"""The executor-side view of the running batch, kept from SchedulerOutput deltas.

A real model runner keeps per-request state across steps and applies only what each
``SchedulerOutput`` changed; this tracker does the same with two integers per request (prompt
length and tokens known), which is all a simulated or timed executor needs to tell which
requests sample a token this step and how much context the step's attention reads.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from llmtower.core.outputs import SchedulerOutput

# Shared, never mutated: the scheduler only reads sampled-token lists.
SAMPLED = [1]
NOT_SAMPLED: list[int] = []


@dataclass
class StepShape:
    """Aggregate counts of one step: what the cost model needs, and who samples."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    num_tokens: int
    num_sampled: int
    attn_pairs: int  # (query, key) token pairs over the batch
    kv_tokens: int  # sum of the scheduled requests' context lengths after the step
    num_seqs: int
    num_swapped_blocks: int
    num_prefill_tokens: int
    num_decode_tokens: int


class BatchTracker:
    """Owns what the executor must remember about each request, updated only from
    SchedulerOutput deltas: its prompt length, and, while it is catching up with its known
    tokens (a prefill, chunked or not, or a recompute after preemption), the number of tokens
    to reach and its progress; plus which requests were preempted (they come back "resumed").

    A request that has caught up is decoding: one token per step, always sampled, so a step
    costs a few C-level passes over the batch plus Python work only for the (few) requests in
    prefill.
    """

    def __init__(self) -> None:
        self._num_prompt: dict[str, int] = {}
        self._catching_up: dict[str, list[int]] = {}  # rid -> [tokens to reach, computed]
        self._preempted: dict[str, None] = {}  # a dict, not a set: iteration order is fixed

    def __len__(self) -> int:
        return len(self._num_prompt)

    def forget(self, req_ids) -> None:
        for rid in req_ids:
            self._num_prompt.pop(rid, None)
            self._catching_up.pop(rid, None)
            self._preempted.pop(rid, None)

    def step(self, so: SchedulerOutput) -> StepShape:
        """Apply one step's deltas and return its shape; every request whose scheduled tokens
        reach the end of its known tokens samples one token (the constant 1)."""
        if so.finished_req_ids:
            self.forget(so.finished_req_ids)
        nst = so.num_scheduled_tokens
        cached = so.scheduled_cached_reqs
        catching = self._catching_up
        for new in so.scheduled_new_reqs:
            p = len(new.prompt_token_ids)
            self._num_prompt[new.req_id] = p
            catching[new.req_id] = [p, new.num_computed_tokens]
            self._preempted.pop(new.req_id, None)
        if self._preempted:
            self._resume(cached, nst)
        if so.preempted_req_ids:
            self._preempted.update(dict.fromkeys(sorted(so.preempted_req_ids)))
        req_ids = list(nst)
        num_reqs = len(req_ids)
        sampled = [SAMPLED] * num_reqs
        # Every request reads its whole context: computed tokens before the step + new ones.
        computed = (sum(map(_computed, cached)) + sum(map(_computed, so.scheduled_new_reqs)))
        kv = computed + so.total_num_scheduled_tokens
        # Attention pairs: a decode adds its context (computed + 1); fix up the prefills.
        attn = computed + num_reqs
        partial: list[str] = []
        done: list[str] = []
        for rid, state in catching.items():
            n = nst.get(rid)
            if n is None:
                continue
            target, comp = state
            attn += n * comp + ((n * (n + 1)) >> 1) - comp - 1
            end = comp + n
            if end >= target:
                done.append(rid)
            else:
                state[1] = end
                partial.append(rid)
        for rid in done:
            del catching[rid]
        if partial:
            where = {rid: i for i, rid in enumerate(req_ids)}
            for rid in partial:
                sampled[where[rid]] = NOT_SAMPLED
        return StepShape(req_ids, sampled, so.total_num_scheduled_tokens, num_reqs - len(partial),
                         attn, kv, num_reqs,
                         len(so.blocks_to_swap_out) + len(so.blocks_to_swap_in),
                         so.num_prefill_tokens, so.num_decode_tokens)

    def _resume(self, cached, nst) -> None:
        """Preempted requests scheduled again restate their outputs and progress."""
        back = [rid for rid in self._preempted if rid in nst]
        if not back:
            return
        entry = {c.req_id: c for c in cached if c.resumed_from_preemption}
        for rid in back:
            c = entry[rid]
            self._catching_up[rid] = [self._num_prompt[rid] + len(c.new_token_ids),
                                      c.num_computed_tokens]
            del self._preempted[rid]


_computed = attrgetter("num_computed_tokens")
