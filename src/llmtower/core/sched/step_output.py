"""Recording a step's decisions and emitting them: what scheduling ``n`` tokens of a request
means for the step (budget, blocks, prefix cache, drafts, prefill counts), and the
``SchedulerOutput`` built from the finished step: new requests in full (once), the others as
deltas, and every request's ``num_computed_tokens`` advanced by what was scheduled."""
from __future__ import annotations

from llmtower.core.kv_cache.block_pool import KVCacheBlock
from llmtower.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from llmtower.core.request import Request
from llmtower.core.sched.scheduler_state import SchedulerState
from llmtower.core.sched.step import Step

_EMPTY: list[int] = []


class StepOutputMixin(SchedulerState):
    """Books scheduled requests into the step and turns the step into a ``SchedulerOutput``."""

    def _mark_scheduled(self, req: Request, n: int, new_blocks: list[KVCacheBlock] | None,
                        step: Step) -> None:
        rid = req.request_id
        step.scheduled[rid] = n
        step.budget -= n
        if new_blocks:
            step.new_blocks[rid] = [b.block_id for b in new_blocks]
        if self.policy.charge is not None:
            self.policy.charge(req, n)
        known = len(req.all_token_ids)
        num_tokens = known + req.num_output_placeholders
        # Draft tokens and placeholders (tokens not sampled yet) are never cached.
        if self.kv.enable_prefix_caching:
            self._cache_scheduled_blocks(req, min(req.num_computed_tokens + n, known), step)
        if req.num_computed_tokens + 1 == num_tokens > req.num_prompt_tokens:
            if n > 1:  # a decode with draft tokens (lookahead): verified in one pass
                step.spec[rid] = req.spec_token_ids[:n - 1]
            return  # a decode step
        if req.num_computed_tokens + n < num_tokens:
            step.num_partial += 1
        step.num_prefill_tokens += n

    def _cache_scheduled_blocks(self, req: Request, end: int, step: Step) -> None:
        """Register the blocks this step fills for ``req`` in the prefix cache now."""
        rid = req.request_id
        kv = self.kv
        start = kv.num_cached_blocks.get(rid, 0)
        if end // self.cache_config.block_size <= start:
            return
        step.cached_from.setdefault(rid, start)
        kv.cache_blocks(req, end)
        if not self.policy.may_displace:
            return  # (the owners matter only where a later admission may displace them)
        blocks = kv.req_to_blocks[rid]
        # (not the blocks a sliding window already returned: kv.num_dead_blocks)
        for b in blocks[max(start, kv.num_dead_blocks.get(rid, 0)):kv.num_cached_blocks[rid]]:
            step.provisional[b.block_id] = req

    def _build_output(self, step: Step) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        constrained: list[Request] = []
        reqs = self.requests
        sched_reqs: dict[str, Request] = {}
        # Bound once: this loop runs per request per step.
        executor_has, resumed, new_blocks = self._executor_has, step.resumed, step.new_blocks
        forced = self._forced_token_ids
        add_cached = cached_reqs.append
        for rid, n in step.scheduled.items():
            req = sched_reqs[rid] = reqs[rid]
            if rid not in executor_has:
                executor_has.add(rid)
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params,
                                               self.kv.get_block_ids(rid), req.num_computed_tokens,
                                               req.eos_token_id, req.lora_request))
            elif rid in resumed:
                forced.pop(rid, None)  # all outputs travel below
                add_cached(CachedRequestData(rid, self.kv.get_block_ids(rid),
                                             req.num_computed_tokens, True, req.output_token_ids))
            else:
                add_cached(CachedRequestData(rid, new_blocks.get(rid, _EMPTY),
                                             req.num_computed_tokens, False,
                                             forced.pop(rid, _EMPTY) if forced else _EMPTY))
            req.num_computed_tokens += n  # the one rule: catch up by what was scheduled
            if req.structured_output is not None and req.num_computed_tokens >= len(
                    req.all_token_ids):
                constrained.append(req)  # samples this step: needs its grammar's mask
        total = step.num_tokens
        out = SchedulerOutput(
            scheduled_new_reqs=new_reqs,
            scheduled_cached_reqs=cached_reqs,
            num_scheduled_tokens=step.scheduled,
            total_num_scheduled_tokens=total,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            swap_out_compressed=step.swap_out_int8,
            swap_in_compressed=step.swap_in_int8,
            blocks_to_move=step.moves,
            scheduled_spec_decode_tokens=step.spec,
            num_waiting_reqs=len(self.waiting),
            preempted_req_ids={r.request_id for r in step.preempted},
            finished_req_ids=self.finished_req_ids,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=total - step.num_prefill_tokens,
            scheduled_requests=sched_reqs,
        )
        if constrained:
            so = self.structured_output
            assert so is not None  # a constrained request is only admitted with a manager
            out.structured_output_request_ids, out.grammar_bitmask = so.grammar_bitmask(constrained)
        self.finished_req_ids = set()
        self.num_steps += 1
        self._last = step
        return out
