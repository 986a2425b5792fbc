"""Preemption's mechanics: taking a victim off ``running`` (its tokens scheduled earlier in
the step given back) and either swapping its blocks out to CPU or freeing them for a
recompute. *Who* is preempted, and when, is the step's decision (scheduler.py asks the policy)."""
from __future__ import annotations

from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.scheduler_state import SchedulerState
from llmtower.core.sched.step import Step


class PreemptionMixin(SchedulerState):
    """Preempts a request the step chose: by swap (into ``swapped``) or by recompute."""

    def _preempt(self, victim: Request, step: Step, now: float) -> None:
        """Take ``victim`` off ``running``: swap its blocks out, or free them (recompute)."""
        self.running.remove(victim)
        victim.spec_token_ids = []  # proposed for the old progress; new ones come later
        self._unschedule(victim, step)
        self.num_preemptions += 1
        victim.num_preemptions += 1
        victim.times.preempted.append(now)
        step.preempted.append(victim)
        # Swap-outs and swap-ins never share a step: the executor copies out before it copies
        # in, so a CPU block freed by a swap-in, or a device block just swapped into, must
        # not be the target or source of a swap-out in the same step.
        # Degradation level 2 (or --swap-space-dtype int8): the swap copy is int8.
        compress = self.kv.compress_swap(self.degradation.level)
        if (self.config.preemption_mode == "swap" and victim.num_computed_tokens > 0
                and not step.swap_in and self.kv.can_swap_out(victim, compress)):
            step.swap_out.extend(self.kv.swap_out(victim, compress, step.swap_out_int8))
            self.num_swap_outs += 1
            if compress:
                self.degradation.actions["compress"] += 1
            victim.status = RequestStatus.SWAPPED
            self.swapped.append(victim)
        else:
            self.kv.free(victim)
            victim.num_computed_tokens = 0
            victim.status = RequestStatus.PREEMPTED

    def _unschedule(self, victim: Request, step: Step) -> None:
        """If ``victim`` was scheduled earlier in this step, give its tokens back."""
        rid = victim.request_id
        n = step.scheduled.pop(rid, None)
        if n is None:
            return
        step.budget += n
        step.spec.pop(rid, None)
        step.new_blocks.pop(rid, None)
        step.resumed.discard(rid)
        computed, num_tokens = victim.num_computed_tokens, victim.num_tokens_with_placeholders
        if not computed + 1 == num_tokens > victim.num_prompt_tokens:  # not a decode
            step.num_prefill_tokens -= n
            if computed + n < num_tokens:
                step.num_partial -= 1
        if self.policy.charge is not None:
            self.policy.charge(victim, -n)
        first = step.cached_from.pop(rid, None)
        if first is not None:  # blocks this step would have computed hold nothing
            self.kv.uncache_blocks(victim, first)

    def waiting_add_preempted(self, req: Request) -> None:
        """A request preempted by recompute goes back to the front of ``waiting``."""
        if req.status == RequestStatus.PREEMPTED:
            self.waiting.add_front(req)
