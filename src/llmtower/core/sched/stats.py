"""The scheduler's statistics (``get_stats``: queues, KV cache, counters, the last step, spec
decoding, degradation) and a finished request's metrics; the operator surface beside them
(prefix cache reset, defragmentation)."""
from __future__ import annotations

from itertools import chain

from llmtower.core.kv_cache.fragmentation import external_fragmentation
from llmtower.core.kv_cache.relocator import DefragResult, Move
from llmtower.core.outputs import RequestMetrics, SchedulerStats
from llmtower.core.request import Request
from llmtower.core.sched.lora_slots import lora_stats
from llmtower.core.sched.scheduler_state import SchedulerState


class StatsMixin(SchedulerState):
    """What the scheduler reports to metrics and operators."""

    def get_stats(self) -> SchedulerStats:
        kv = self.kv
        if not self.requests:
            self.degradation.on_idle()
        step = self._last
        total = step.num_tokens
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar)
            + len(self.waiting_for_adapter),
            num_swapped_reqs=len(self.swapped),
            kv_cache_usage=kv.usage(),
            num_free_blocks=kv.pool.num_free_blocks,
            num_total_blocks=kv.pool.num_blocks,
            num_free_cpu_blocks=len(kv.free_cpu_blocks),
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_evictions=kv.pool.num_evictions,
            fragmentation=kv.fragmentation(self.running),
            external_fragmentation=external_fragmentation(kv.pool),
            num_cached_blocks=len(kv.pool.cached),
            num_preemptions_total=self.num_preemptions,
            num_swap_outs_total=self.num_swap_outs,
            num_swap_ins_total=self.num_swap_ins,
            num_rejected_total=self.num_rejected,
            num_steps=self.num_steps,
            last_step_num_tokens=total,
            last_step_num_prefill_tokens=step.num_prefill_tokens,
            last_step_num_decode_tokens=total - step.num_prefill_tokens,
            token_budget=self.config.max_num_batched_tokens,
            tenants=self.policy.tenant_stats(),
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_num_accepted_tokens_per_pos=list(self.spec_stats.accepted_per_pos),
            **lora_stats(self.config.max_loras, self.running,
                         chain(self.waiting, self.waiting_for_adapter.values())),
            num_block_moves_total=self.relocator.num_moves_total,
            num_pinned_blocks=len(kv.pinned),
            degradation_level=self.degradation.level,
            degradation_actions=dict(self.degradation.actions),
        )

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request holds KV blocks."""
        return self.kv.reset_prefix_cache()

    def defragment(self) -> tuple[list[Move], DefragResult]:
        """A full defragmentation between two steps: the moves (for the executor, which must
        perform them before the next forward pass) and what they achieved."""
        return self.relocator.defragment(self.kv.block_tables())


def request_metrics(req: Request) -> RequestMetrics:
    """A finished request's metrics, for its client's last output."""
    t = req.times
    return RequestMetrics(
        arrival_time=t.arrival, queue_time=t.queue_time, ttft=t.ttft,
        prefill_time=t.prefill_time, decode_time=t.decode_time,
        e2e_latency=max(0.0, t.finished - t.arrival), num_preemptions=req.num_preemptions,
        num_cached_tokens=max(0, req.num_cached_tokens),
        num_prompt_tokens=req.num_prompt_tokens,
        num_generation_tokens=req.num_output_tokens,
        spec_num_draft_tokens=req.spec_num_draft_tokens,
        spec_num_accepted_tokens=req.spec_num_accepted_tokens)
