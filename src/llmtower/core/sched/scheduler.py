"""The scheduler: before every forward pass, decide who runs, with how many tokens, on which
KV blocks, and who is preempted. The whole decision is in this file: ``schedule()`` is the
step's outline, and its phases follow it in order, read top to bottom.

One rule drives it (vLLM v1): each request's ``num_computed_tokens`` catches up with its
``num_tokens`` within the step's token budget. A new prompt, a chunk of a long prompt, a
decode step, a prefix-cache hit (which starts the count above zero) and a recompute after
preemption (which resets it to zero) are all the same thing.

A step, in order:
  1. running requests (decodes and ongoing chunked prefills), preempting the policy's victim
     (``policy.py``: lowest priority, then latest arrival and admission) when KV blocks run out;
  2. swapped requests back in, if nobody was preempted in (1);
  3. waiting requests, in policy order, if nobody was preempted and nothing is swapped out:
     prefix-cache lookup, allocation, a chunk that fits the remaining budget. One that does not
     fit is skipped (no head-of-line blocking) but counts how often it is overtaken; after
     ``max_bypass`` overtakes nobody behind it is admitted until it fits. Under ``priority`` a
     waiting request may preempt strictly lower-priority running ones (under ``fair``: another
     tenant's more-served ones), at the KV limit and at ``max_num_seqs``;
  4. block moves (``--kv-allocator relocator``).

Blocks a prefill chunk fills are registered in the prefix cache when it is scheduled, so a
request admitted later in the same step hits them.

The rest of the scheduler's jobs live beside it, one file each, as mixins over the state in
``scheduler_state.py``: admission (``add_request``, aborts, priorities), grammar glue,
preemption's mechanics (swap out or free), booking a step and building its
``SchedulerOutput`` (``step_output.py``), applying a step's outputs (``update_from_output``),
runs of plain decode steps applied in one pass (``decode_run.py``, for the simulator) and the
statistics. The step's scratch state is ``step.py``.
"""
from __future__ import annotations

from llmtower.core.kv_cache.block_pool import KVCacheBlock
from llmtower.core.kv_cache.relocator import written_blocks
from llmtower.core.outputs import SchedulerOutput
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.admission import AdmissionMixin
from llmtower.core.sched.lora_slots import lora_slots
from llmtower.core.sched.apply_output import ApplyOutputMixin
from llmtower.core.sched.decode_run import DecodeRunMixin
from llmtower.core.sched.preemption import PreemptionMixin
from llmtower.core.sched.stats import StatsMixin
from llmtower.core.sched.step import Step
from llmtower.core.sched.step_output import StepOutputMixin

# Waiting requests skipped in one step before the scan stops: keeps a step O(1) in the
# queue length even when thousands wait behind a full KV cache.
MAX_SKIPS_PER_STEP = 64


class Scheduler(AdmissionMixin, ApplyOutputMixin, PreemptionMixin, StepOutputMixin, StatsMixin,
                DecodeRunMixin):
    """Owns the waiting / running / swapped queues, the KV cache manager and every request
    from admission to its end (state: ``SchedulerState``); decides each step."""

    # ================================================================ one step
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        deg = self.degradation
        step = Step(deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill),
                    deg.max_num_seqs(cfg.max_num_seqs))
        now = self.clock()
        if self.waiting_for_adapter:
            self._admit_loaded_adapters()
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()
        # 1. running requests: decodes and ongoing chunked prefills
        self._schedule_running(step, now)
        # 2. swapped requests come back first, if memory is not under pressure
        if not step.preempted:
            self._swap_in(step)
        # 3. waiting requests, in policy order
        if not step.preempted and not self.swapped:
            self._admit_waiting(step, now)
        # 4. block moves (relocator): never in a step that swaps, never a written block
        if (self.cache_config.kv_allocator == "relocator" and step.scheduled
                and not (step.swap_out or step.swap_in)):
            step.moves = self.relocator.plan_step(
                self.kv.block_tables(), written_blocks(self.kv.req_to_blocks, self.requests,
                                                       step.scheduled, self.cache_config.block_size))
        deg.on_step(len(step.preempted), self.kv.pool.num_evictions, len(self.running))
        return self._build_output(step)

    # ---------------------------------------------------------------- 1. running
    def _schedule_running(self, step: Step, now: float) -> None:
        """Decodes and ongoing chunked prefills, in ``running`` order; out of KV blocks, the
        policy's victims are preempted until the request fits or is the victim itself."""
        req_to_blocks = self.kv.req_to_blocks
        bs = self.cache_config.block_size
        window = self.kv.window
        scheduled = step.scheduled
        charge = self.policy.charge  # per-tenant service accounting (None: not needed)
        if self.policy.may_displace and self.waiting and not self.swapped:
            step.reserve_for = self.waiting.peek()  # see _prefill_budget
        running = self.running
        i = 0
        while i < len(running) and step.budget > 0:
            req = running[i]
            computed = req.num_computed_tokens
            placeholders = req.num_output_placeholders
            num_tokens = len(req.all_token_ids) + placeholders  # num_tokens_with_placeholders
            if placeholders and self._at_length_cap(req, num_tokens):
                i += 1  # --async-scheduling: the step in flight samples its last token
                continue
            if (num_tokens - computed == 1 and num_tokens > req.num_prompt_tokens
                    and not req.spec_token_ids):
                rid = req.request_id
                if computed < len(req_to_blocks[rid]) * bs:
                    # The common case: a decode whose last block still has a free slot.
                    if window:  # blocks the window left go back now (else at the next block)
                        self.kv.free_outside_window(req)
                    scheduled[rid] = 1
                    step.budget -= 1
                    if charge is not None:
                        charge(req, 1)
                    i += 1
                    continue
            n = self._num_new_tokens(req, computed, step)
            if n == 0:
                i += 1
                continue
            if n == 1 and req.spec_token_ids:
                n = self._with_drafts(req, step)
            new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None and n > 1 and req.spec_token_ids:
                req.spec_token_ids = []  # drafts never preempt anyone: decode without them
                n = 1
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                new_blocks, i = self._preempt_until_fits(req, n, i, step, now)
                if new_blocks is None:
                    continue  # req itself was preempted; running[i] is now the next request
            self._mark_scheduled(req, n, new_blocks, step)
            i += 1
        step.reserve_for = None

    def _preempt_until_fits(self, req: Request, n: int, i: int, step: Step, now: float
                            ) -> tuple[list[KVCacheBlock] | None, int]:
        """Out of KV blocks for ``running[i]``: preempt the policy's victim until ``n`` slots
        fit or ``req`` is the victim. Returns its new blocks (None: it was preempted) and its
        index in ``running`` now."""
        new_blocks = None
        while new_blocks is None:
            victim = self.policy.victim(self.running)
            victim_index = self.running.index(victim)
            self._preempt(victim, step, now)
            self.waiting_add_preempted(victim)
            if victim is req:
                break
            if victim_index < i:
                i -= 1
            new_blocks = self.kv.allocate_slots(req, n)
        return new_blocks, i

    # ---------------------------------------------------------------- 2. swapped
    def _swap_in(self, step: Step) -> None:
        """Swapped requests, oldest first, while their blocks, tokens and adapters fit."""
        loras = step.loras = lora_slots(self.config.max_loras, self.running) \
            if self.swapped else None
        while self.swapped and step.budget > 0 and len(self.running) < step.max_seqs:
            req = self.swapped[0]
            n = self._num_new_tokens(req, req.num_computed_tokens, step)
            if n == 0 or not self.kv.can_swap_in(req, n) or (
                    loras is not None and not loras.admits(req)):
                break
            if loras is not None:
                loras.add(req)
            self.swapped.popleft()
            step.swap_in.extend(self.kv.swap_in(req, step.swap_in_int8))
            self.num_swap_ins += 1
            new_blocks = self.kv.allocate_slots(req, n)
            assert new_blocks is not None  # can_swap_in checked the room for both
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            step.resumed.add(req.request_id)
            self._mark_scheduled(req, n, new_blocks, step)

    # ---------------------------------------------------------------- 3. waiting
    def _admit_waiting(self, step: Step, now: float) -> None:
        """Waiting requests in policy order: prefix-cache lookup, allocation (displacing
        lower-ranked running requests where the policy allows), skip what does not fit."""
        cfg = self.config
        skipped: list[Request] = []
        displaced: list[Request] = []  # preempted by priority here; requeued after the scan
        loras = step.loras = lora_slots(cfg.max_loras, self.running)  # None: LoRA off
        while self.waiting and step.budget > 0 and len(skipped) < MAX_SKIPS_PER_STEP:
            req = self.waiting.peek()
            if loras is not None and not loras.admits(req):
                # Its adapter would make one too many: it waits as one that does not fit
                # (skipped, never overtaken more than max_bypass times).
                self.waiting.pop()
                skipped.append(req)
                if req.num_bypassed >= cfg.max_bypass:
                    break
                continue
            if len(self.running) >= step.max_seqs:
                if not self._preempt_lower_priority(req, step, now, displaced):
                    break
            hits, num_hit = self.kv.get_computed_blocks(req)
            if step.provisional and hits:  # (recorded only under a displacing policy)
                hits, num_hit = self._same_step_hits(req, hits, step)
            if hits and req.sampling_params.prompt_logprobs is not None:
                hits, num_hit = [], 0  # prompt logprobs need every prompt token's logits
            n = self._num_new_tokens(req, num_hit, step)
            new_blocks = None if n == 0 else self.kv.allocate_slots(req, n, hits, num_hit)
            while new_blocks is None and n and self._preempt_lower_priority(req, step, now, displaced):
                new_blocks = self.kv.allocate_slots(req, n, hits, num_hit)
            self.waiting.pop()
            if new_blocks is None:
                # Does not fit now: skip it (no head-of-line blocking) unless it has been
                # overtaken too often, in which case nobody behind it goes first.
                skipped.append(req)
                if req.num_bypassed >= cfg.max_bypass:
                    break
                continue
            reserve = False
            for s in skipped:
                s.num_bypassed += 1
                reserve = reserve or s.num_bypassed >= cfg.max_bypass
            self._start_running(req, num_hit, now, step)
            self._mark_scheduled(req, n, new_blocks, step)
            if reserve:
                break  # a skipped request has been overtaken enough: nobody else goes first
        self.waiting.prepend(skipped)
        for r in displaced:
            self.waiting_add_preempted(r)

    def _start_running(self, req: Request, num_hit: int, now: float, step: Step) -> None:
        """An admitted waiting request joins ``running`` with its prefix-cache hits computed."""
        req.num_bypassed = 0
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = num_hit
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_hit
        if not req.times.first_scheduled:
            req.times.first_scheduled = now
        self.policy.on_admit(req)
        if step.loras is not None:
            step.loras.add(req)
        self.running.append(req)
        if req.request_id in self._executor_has:
            step.resumed.add(req.request_id)

    def _preempt_lower_priority(self, req: Request, step: Step, now: float,
                                displaced: list[Request]) -> bool:
        """Under a displacing policy (``priority``, ``fair``): preempt the policy's victim if
        ``req`` may displace it. Returns whether one was preempted."""
        if not self.policy.may_displace or not self.running:
            return False
        victim = self.policy.displacement_victim(req, self.running)
        if victim is None:
            return False
        self._preempt(victim, step, now)
        displaced.append(victim)
        return True

    def _same_step_hits(self, req: Request, hits: list[KVCacheBlock], step: Step
                        ) -> tuple[list[KVCacheBlock], int]:
        """Keep the prefix hits on blocks computed this step only if their owner cannot be
        displaced later in this step (the policy says): a displaced owner never computes them."""
        if self.policy.may_displace:
            for i, b in enumerate(hits):
                owner = step.provisional.get(b.block_id)
                if owner is not None and not self.policy.same_step_hit_ok(req, owner):
                    hits = hits[:i]
                    break
        return hits, len(hits) * self.cache_config.block_size

    # ---------------------------------------------------------------- how many tokens
    def _num_new_tokens(self, req: Request, num_computed: int, step: Step) -> int:
        """Tokens to compute for ``req`` this step (0: not this step)."""
        remaining = req.num_tokens_with_placeholders - num_computed
        if remaining == 1:
            return 1  # a decode step (the caller guarantees budget > 0)
        cfg = self.config
        n = remaining
        if n > 1 and cfg.long_prefill_token_threshold and cfg.enable_chunked_prefill:
            n = min(n, cfg.long_prefill_token_threshold)
        budget = step.budget if step.reserve_for is None else self._prefill_budget(req, step)
        if n > budget:
            if not cfg.enable_chunked_prefill or budget == 0:
                return 0
            n = budget
        if n < remaining:  # a partial prefill
            if step.num_partial >= cfg.max_num_partial_prefills:
                return 0
        return n

    def _prefill_budget(self, req: Request, step: Step) -> int:
        """Budget reservation: the budget a running request's prefill chunk may take when the
        head of ``waiting`` is a request the policy serves before it (``fair``: a less-served
        tenant; ``priority``: a more important request). It leaves room for the head's prompt
        (up to ``long_prefill_token_threshold``) so that the head starts this step instead of
        waiting behind a long prompt's chunks; decodes never yield, a yielding prefill keeps at
        least one token, nothing is preempted and the step's budget is never exceeded. Nothing
        is reserved for a head that cannot be admitted this step (no free sequence slot and
        nobody it may displace)."""
        head = step.reserve_for
        if head is None or req is head or not self.policy.yields_budget(req, head):
            return step.budget
        if step.reserve < 0:  # sized once, at the first request that yields
            step.reserve = 0
            running = self.running
            if (len(running) < step.max_seqs
                    or self.policy.displacement_victim(head, running) is not None):
                cfg = self.config
                need = head.num_tokens - head.num_computed_tokens
                if cfg.long_prefill_token_threshold:
                    need = min(need, cfg.long_prefill_token_threshold)
                step.reserve = need
        # At least one token: the yielding prefill always progresses, so a head that does not
        # fit in the KV cache after all cannot hold it (and the blocks it holds) still.
        return max(1, step.budget - step.reserve)

    def _at_length_cap(self, req: Request, num_tokens: int) -> bool:
        """Whether ``num_tokens`` (placeholders included) already reach the request's
        max_tokens or the length cap: then the step in flight samples its last token, and
        another step would compute one past its end (``_check_stop`` ends it on arrival)."""
        return (num_tokens - req.num_prompt_tokens >= req.max_tokens
                or num_tokens >= self.max_len)

    @staticmethod
    def _with_drafts(req: Request, step: Step) -> int:
        """A decode with draft tokens: the last token + as many drafts as the budget takes."""
        k = min(len(req.spec_token_ids), step.budget - 1)
        if k < len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:k]
        return 1 + k
