"""The scheduler: before every forward pass, decide who runs, with how many tokens, on which
KV blocks, and who is preempted. The whole decision is ``schedule()``, read top to bottom.

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
     tenant's more-served ones), at the KV limit and at ``max_num_seqs``.

Blocks a prefill chunk fills are registered in the prefix cache when it is scheduled, so a
request admitted later in the same step hits them. Outputs are matched to the request objects
their step scheduled, never to ids alone (ids are reused; two steps may be in flight).
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.kv_cache.fragmentation import external_fragmentation
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.kv_cache.relocator import BlockRelocator, DefragResult, Move, written_blocks
from llmtower.core.outputs import (CachedRequestData, EngineCoreOutput, EngineCoreOutputs,
                                   ModelRunnerOutput, NewRequestData, RequestMetrics,
                                   SchedulerOutput, SchedulerStats)
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.degradation import DegradationConfig, DegradationController
from llmtower.core.sched.lora_slots import lora_slots, lora_stats
from llmtower.core.sched.policy import make_policy
from llmtower.structured_output.manager import StructuredOutputManager
from llmtower.spec_decode.scheduling import SpecDecodingStats, apply_verification, next_drafts

# Waiting requests skipped in one step before the scan stops: keeps a step O(1) in the
# queue length even when thousands wait behind a full KV cache.
MAX_SKIPS_PER_STEP = 64
# With only grammar-waiting requests, schedule() waits this long for a compile to finish.
GRAMMAR_WAIT_S = 0.01


class _Step:
    """Scratch state of one ``schedule()`` call."""

    __slots__ = ("budget", "scheduled", "new_blocks", "resumed", "preempted", "num_partial",
                 "swap_out", "swap_in", "num_prefill_tokens", "moves", "spec", "cached_from",
                 "provisional", "initial_budget", "max_seqs", "swap_out_int8", "swap_in_int8",
                 "reserve_for", "reserve")

    def __init__(self, budget: int, max_seqs: int = 1 << 30) -> None:
        self.budget = budget
        self.initial_budget = budget  # the step's token budget (degradation may cut it)
        self.max_seqs = max_seqs  # the step's max_num_seqs (degradation may cut it)
        self.scheduled: dict[str, int] = {}  # insertion order = batch order
        self.new_blocks: dict[str, list[int]] = {}
        self.resumed: set[str] = set()
        self.preempted: list[Request] = []
        self.num_partial = 0
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.swap_out_int8: list[int] = []  # device blocks whose swap copy is int8
        self.swap_in_int8: list[int] = []
        self.num_prefill_tokens = 0
        self.moves: list[tuple[int, int]] = []  # the relocator's block moves
        self.spec: dict[str, list[int]] = {}  # draft tokens scheduled per request
        # Prefix caching of blocks this step computes, registered when scheduled so that a
        # request admitted later in the same step hits them (the runner writes the whole
        # batch's K/V before anyone attends): each request's first block cached this step,
        # and the owner of every such block (see _same_step_hits).
        self.cached_from: dict[str, int] = {}
        self.provisional: dict[int, Request] = {}
        # Budget reservation (phase 1 only): the waiting head that running prefills the
        # policy puts after it leave room for, and how much (-1: not sized yet).
        self.reserve_for: Request | None = None
        self.reserve = -1


class Scheduler:
    """Owns the waiting / running / swapped queues, the KV cache manager and every request
    from admission to its end."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.kv = KVCacheManager(cache_config)
        self.degradation = DegradationController(
            DegradationConfig(enabled=scheduler_config.enable_degradation,
                              compress_available=(scheduler_config.preemption_mode == "swap"
                                                  and self.kv.swap_layout.compressible)),
            clock=clock)
        # Block moves: every step under --kv-allocator relocator, and on demand (defragment()).
        self.relocator = BlockRelocator(self.kv.pool, cache_config.fragmentation_threshold,
                                        cache_config.max_block_moves_per_step)
        self.requests: dict[str, Request] = {}
        # The policy: the waiting queue's order and the preemption-victim rule.
        self.policy = make_policy(scheduler_config)
        self.waiting = self.policy.make_queue()
        self._num_added = 0  # admission sequence numbers (Request.seq)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the executor
        self._executor_has: set[str] = set()  # requests whose full data the executor holds
        # The longest sequence that can ever be in the KV cache at once.
        self.max_len = min(scheduler_config.max_model_len,
                           cache_config.num_blocks * cache_config.block_size)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_rejected = 0
        self.num_steps = 0
        self.spec_stats = SpecDecodingStats()
        self._last = _Step(0)
        # Structured outputs: the grammar manager, requests whose grammar is still compiling
        # (outside `waiting`: they block nobody), requests that failed after admission, and
        # jump-forward tokens the executor has not seen yet.
        self.structured_output = structured_output
        self.waiting_for_grammar: dict[str, Request] = {}
        self._request_errors: list[tuple[str, str]] = []
        self._forced_token_ids: dict[str, list[int]] = {}

    # ================================================================ admission
    def add_request(self, request: Request) -> None:
        """Admit a request to ``waiting``, or raise: AdmissionError if it can never run
        (HTTP 400), QueueFullError if the queue limits are reached (HTTP 429)."""
        cfg = self.config
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use; request ids must be unique")
        if request.priority != 0 and not self.policy.uses_priority:
            self.num_rejected += 1
            raise AdmissionError(
                f"request {rid!r} has priority={request.priority} but the scheduler policy is "
                f"{cfg.policy!r}; priorities need --policy priority")
        min_len = request.num_prompt_tokens + max(1, request.sampling_params.min_tokens)
        if min_len > cfg.max_model_len:
            self.num_rejected += 1
            raise AdmissionError(
                f"request {rid!r} needs {min_len} tokens ({request.num_prompt_tokens} prompt + "
                f"{max(1, request.sampling_params.min_tokens)} to generate) but max_model_len is "
                f"{cfg.max_model_len}{_because(cfg.max_model_len_reason)}; shorten the prompt "
                "or lower min_tokens")
        capacity = self.cache_config.num_blocks * self.cache_config.block_size
        if min_len > capacity:
            self.num_rejected += 1
            raise AdmissionError(
                f"request {rid!r} needs {min_len} tokens but the whole KV cache holds only "
                f"{capacity} ({self.cache_config.num_blocks} blocks of "
                f"{self.cache_config.block_size}); give the KV cache more memory")
        if cfg.max_num_queued_tokens and request.num_tokens > cfg.max_num_queued_tokens:
            self.num_rejected += 1
            raise AdmissionError(
                f"request {rid!r} has {request.num_tokens} prompt tokens, more than the waiting "
                f"queue may ever hold (max_num_queued_tokens={cfg.max_num_queued_tokens}); "
                "shorten the prompt")
        if not self.requests:
            self.degradation.on_idle()
        try:  # under heavy KV pressure (degradation level 4) new work is shed early
            self.degradation.check_admission(rid)
        except QueueFullError:
            self.num_rejected += 1
            raise
        if cfg.max_num_queued_reqs and len(self.waiting) >= cfg.max_num_queued_reqs:
            self.num_rejected += 1
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} requests, "
                                 f"max_num_queued_reqs={cfg.max_num_queued_reqs}); retry later")
        if (cfg.max_num_queued_tokens
                and self.waiting.num_tokens + request.num_tokens > cfg.max_num_queued_tokens):
            self.num_rejected += 1
            raise QueueFullError(
                f"the waiting queue holds {self.waiting.num_tokens} prompt tokens and this "
                f"request adds {request.num_tokens}, over max_num_queued_tokens="
                f"{cfg.max_num_queued_tokens}; retry later")
        # Generation stops at the context length or when the sequence would outgrow the cache.
        room = self.max_len - request.num_prompt_tokens
        asked = request.sampling_params.max_tokens
        request.max_tokens = room if asked is None else min(asked, room)
        grammar_ready = self._start_grammar(request)  # raises ValueError for a bad grammar
        request.status = RequestStatus.WAITING
        request.times.queued = self.clock()
        self._num_added += 1
        request.seq = self._num_added
        request.sort_key = ()
        self.requests[rid] = request
        self.policy.on_add(request)
        if not grammar_ready:  # waits outside the queue until its grammar has compiled
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[rid] = request
            return
        self.waiting.add(request)

    def abort_requests(self, request_ids) -> list[str]:
        """Abort requests in any state; unknown or already finished ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                del self.waiting_for_grammar[rid]
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(rid)
        return aborted

    def update_priority(self, request_id: str, priority: int) -> bool:
        """Change a request's priority in any state; False if it is unknown or finished.

        Waiting: re-keyed in the queue, so it moves at once. Running or swapped: the new value
        counts from the next victim choice and the next admission decision on."""
        if not self.policy.uses_priority:
            raise ValueError(f"cannot set a priority: the scheduler policy is "
                             f"{self.config.policy!r}; priorities need --policy priority")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, not {priority!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.priority = priority
        self.waiting.rekey(req)  # a no-op unless it waits
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ================================================================ one step
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        deg = self.degradation
        step = _Step(deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill),
                     deg.max_num_seqs(cfg.max_num_seqs))
        now = self.clock()
        if self.waiting_for_grammar:
            self._admit_compiled_grammars()

        # --- 1. running requests: decodes and ongoing chunked prefills -------------------
        req_to_blocks = self.kv.req_to_blocks
        bs = self.cache_config.block_size
        scheduled = step.scheduled
        charge = self.policy.charge  # per-tenant service accounting (None: not needed)
        if self.policy.may_displace and self.waiting and not self.swapped:
            step.reserve_for = self.waiting.peek()  # see _prefill_budget
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            computed = req.num_computed_tokens
            num_tokens = req.num_tokens_with_placeholders
            if req.num_output_placeholders and self._at_length_cap(req, num_tokens):
                i += 1  # --async-scheduling: the step in flight samples its last token
                continue
            if (num_tokens - computed == 1 and num_tokens > req.num_prompt_tokens
                    and computed < len(req_to_blocks[req.request_id]) * bs
                    and not req.spec_token_ids):
                # The common case: a decode whose last block still has a free slot.
                scheduled[req.request_id] = 1
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
            while new_blocks is None:  # out of KV blocks: preempt until it fits or it is the victim
                victim = self.policy.victim(self.running)
                victim_index = self.running.index(victim)
                self._preempt(victim, step, now)
                self.waiting_add_preempted(victim)
                if victim is req:
                    break
                if victim_index < i:
                    i -= 1
                new_blocks = self.kv.allocate_slots(req, n)
            if new_blocks is None:
                continue  # req itself was preempted; running[i] is now the next request
            self._mark_scheduled(req, n, new_blocks, step)
            i += 1
        step.reserve_for = None

        # --- 2. swapped requests come back first, if memory is not under pressure ---------
        if not step.preempted:
            loras = lora_slots(cfg.max_loras, self.running) if self.swapped else None
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

        # --- 3. waiting requests, in policy order ----------------------------------------
        if not step.preempted and not self.swapped:
            self._admit_waiting(step, now)

        # --- 4. block moves (relocator): never in a step that swaps, never a written block
        if (self.cache_config.kv_allocator == "relocator" and step.scheduled
                and not (step.swap_out or step.swap_in)):
            step.moves = self.relocator.plan_step(
                self.kv.block_tables(), written_blocks(self.kv.req_to_blocks, self.requests,
                                                       step.scheduled, self.cache_config.block_size))
        deg.on_step(len(step.preempted), self.kv.pool.num_evictions, len(self.running))
        return self._build_output(step)

    def _admit_waiting(self, step: _Step, now: float) -> None:
        cfg = self.config
        skipped: list[Request] = []
        displaced: list[Request] = []  # preempted by priority here; requeued after the scan
        loras = lora_slots(cfg.max_loras, self.running)  # None: LoRA off
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
            if step.provisional and hits:
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
            req.num_bypassed = 0
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
            if not req.times.first_scheduled:
                req.times.first_scheduled = now
            self.policy.on_admit(req)
            if loras is not None:
                loras.add(req)
            self.running.append(req)
            if req.request_id in self._executor_has:
                step.resumed.add(req.request_id)
            self._mark_scheduled(req, n, new_blocks, step)
            if reserve:
                break  # a skipped request has been overtaken enough: nobody else goes first
        self.waiting.prepend(skipped)
        for r in displaced:
            self.waiting_add_preempted(r)

    def _num_new_tokens(self, req: Request, num_computed: int, step: _Step) -> int:
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

    def _prefill_budget(self, req: Request, step: _Step) -> int:
        """Budget reservation: the budget a running request's prefill chunk may take when the
        head of ``waiting`` is a request the policy serves before it (``fair``: a less-served
        tenant; ``priority``: a more important request). It leaves room for the head's prompt
        (up to ``long_prefill_token_threshold``) so that the head starts this step instead of
        waiting behind a long prompt's chunks; decodes never yield, a yielding prefill keeps at
        least one token, nothing is preempted and the step's budget is never exceeded. Nothing is reserved for a head that cannot be
        admitted this step (no free sequence slot and nobody it may displace)."""
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
    def _with_drafts(req: Request, step: _Step) -> int:
        """A decode with draft tokens: the last token + as many drafts as the budget takes."""
        k = min(len(req.spec_token_ids), step.budget - 1)
        if k < len(req.spec_token_ids):
            req.spec_token_ids = req.spec_token_ids[:k]
        return 1 + k

    def _same_step_hits(self, req: Request, hits: list, step: _Step) -> tuple[list, int]:
        """Keep the prefix hits on blocks computed this step only if their owner cannot be
        displaced later in this step (the policy says): a displaced owner never computes them."""
        if self.policy.may_displace:
            for i, b in enumerate(hits):
                owner = step.provisional.get(b.block_id)
                if owner is not None and not self.policy.same_step_hit_ok(req, owner):
                    hits = hits[:i]
                    break
        return hits, len(hits) * self.cache_config.block_size

    def _mark_scheduled(self, req: Request, n: int, new_blocks, step: _Step) -> None:
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

    def _cache_scheduled_blocks(self, req: Request, end: int, step: _Step) -> None:
        """Register the blocks this step fills for ``req`` in the prefix cache now."""
        rid = req.request_id
        kv = self.kv
        start = kv.num_cached_blocks.get(rid, 0)
        if end // self.cache_config.block_size <= start:
            return
        step.cached_from.setdefault(rid, start)
        kv.cache_blocks(req, end)
        blocks = kv.req_to_blocks[rid]
        for b in blocks[start:kv.num_cached_blocks[rid]]:
            step.provisional[b.block_id] = req

    # ================================================================ preemption
    def _preempt(self, victim: Request, step: _Step, now: float) -> None:
        """Take ``victim`` off ``running``: swap its blocks out, or free them (recompute)."""
        self.running.remove(victim)
        rid = victim.request_id
        n = step.scheduled.pop(rid, None)
        victim.spec_token_ids = []  # proposed for the old progress; new ones come later
        if n is not None:  # scheduled earlier in this step: give its tokens back
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

    def waiting_add_preempted(self, req: Request) -> None:
        if req.status == RequestStatus.PREEMPTED:
            self.waiting.add_front(req)

    def _preempt_lower_priority(self, req: Request, step: _Step, now: float,
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

    # ================================================================ output of a step
    def _build_output(self, step: _Step) -> SchedulerOutput:
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        constrained: list[Request] = []
        reqs = self.requests
        sched_reqs: dict[str, Request] = {}
        for rid, n in step.scheduled.items():
            req = sched_reqs[rid] = reqs[rid]
            if rid not in self._executor_has:
                self._executor_has.add(rid)
                new_reqs.append(NewRequestData(rid, req.prompt_token_ids, req.sampling_params,
                                               self.kv.get_block_ids(rid), req.num_computed_tokens,
                                               req.eos_token_id, req.lora_request))
            elif rid in step.resumed:
                self._forced_token_ids.pop(rid, None)  # all outputs travel below
                cached_reqs.append(CachedRequestData(rid, self.kv.get_block_ids(rid),
                                                     req.num_computed_tokens, True,
                                                     req.output_token_ids))
            else:
                cached_reqs.append(CachedRequestData(rid, step.new_blocks.get(rid, _EMPTY),
                                                     req.num_computed_tokens, False,
                                                     self._forced_token_ids.pop(rid, _EMPTY)))
            req.num_computed_tokens += n  # the one rule: catch up by what was scheduled
            if req.structured_output is not None and req.num_computed_tokens >= len(
                    req.all_token_ids):
                constrained.append(req)  # samples this step: needs its grammar's mask
        total = step.initial_budget - step.budget
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

    # ================================================================ after the forward pass
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        """Append sampled tokens, stop finished requests, free their blocks at once, cache
        newly full blocks, and report new tokens to the clients."""
        now = self.clock()
        outputs: list[EngineCoreOutput] = []
        stopped: list[Request] = []
        logprobs = model_runner_output.logprobs
        prompt_lps = model_runner_output.prompt_logprobs
        caching = self.kv.enable_prefix_caching
        num_cached_blocks = self.kv.num_cached_blocks
        bs = self.cache_config.block_size
        spec_sched = scheduler_output.scheduled_spec_decode_tokens
        proposed = model_runner_output.spec_token_ids
        sched_reqs = scheduler_output.scheduled_requests
        finished = RequestStatus.FINISHED_STOPPED
        for i, rid in enumerate(model_runner_output.req_ids):
            # The request object this step scheduled: an id it did not schedule is ignored,
            # and so is a request that finished or was aborted since (its id may already
            # belong to a new request).
            req = sched_reqs.get(rid)
            if req is None or req.status >= finished:
                continue
            running = req.status == RequestStatus.RUNNING
            if spec_sched and rid in spec_sched:  # before caching: rejected drafts' KV is not
                apply_verification(req, spec_sched[rid], model_runner_output.sampled_token_ids[i],
                                   self.kv, self.spec_stats)
            if (running and caching
                    and req.num_computed_tokens // bs > num_cached_blocks.get(rid, 0)):
                self.kv.cache_blocks(req, req.num_computed_tokens)  # a block just filled
            if prompt_lps is not None and rid in prompt_lps:
                req.prompt_logprobs = (req.prompt_logprobs or []) + prompt_lps[rid]
            sampled = model_runner_output.sampled_token_ids[i]
            if not sampled:
                continue  # a prefill chunk that has not reached the end of the prompt
            new_tokens = []
            status = None
            for tok in sampled:
                req.all_token_ids.append(tok)
                new_tokens.append(tok)
                status = self._check_stop(req, tok)
                if req.structured_output is not None:
                    status = self._advance_grammar(req, tok, status, new_tokens)
                if status is not None:
                    break
            if req.queue_entry:  # preempted while this step was in flight: back in waiting
                self.waiting.grow(req, len(new_tokens))
            times = req.times
            out = EngineCoreOutput(rid, new_tokens, num_cached_tokens=max(0, req.num_cached_tokens),
                                   num_preemptions=req.num_preemptions)
            if not times.first_token:
                times.first_token = now
                out.queue_time = times.queue_time
            times.last_token = now
            if logprobs is not None and logprobs[i]:
                out.new_logprobs = [(e.token_id, e.logprob, e.rank, e.top)
                                    for e in logprobs[i][:len(new_tokens)]]
            if req.prompt_logprobs is not None:
                out.new_prompt_logprobs = [(e.token_id, e.logprob, e.rank, e.top)
                                           for e in req.prompt_logprobs]
                req.prompt_logprobs = None
            if status is not None:
                if running:
                    stopped.append(req)
                elif req.status == RequestStatus.SWAPPED:
                    self.swapped.remove(req)
                else:
                    self.waiting.remove(req)
                self._finish(req, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = req.stop_reason
                out.metrics = self._metrics(req)
            elif proposed is not None and running and req.structured_output is None:
                # (No drafts for a constrained request: its grammar mask covers one token.)
                req.spec_token_ids = next_drafts(req, proposed[i])
            outputs.append(out)
        if stopped:
            gone = {r.request_id for r in stopped}
            self.running = [r for r in self.running if r.request_id not in gone]
        return EngineCoreOutputs(outputs=outputs, timestamp=now)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        if num_output >= sp.min_tokens:
            if tok == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or num_tokens >= self.max_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    # ================================================================ structured outputs
    def _start_grammar(self, request: Request) -> bool:
        """Start compiling a constrained request's grammar; True when no wait is needed."""
        if request.sampling_params.structured_outputs is None:
            return True
        if self.structured_output is None:
            raise ValueError("structured_outputs are not available in this engine (it was "
                             "built without a grammar backend); remove them from the request")
        return self.structured_output.add_request(request)

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; those whose grammar
        failed or timed out end here (their client gets a 400). With nothing else to run,
        wait a little for a compile rather than spin."""
        so = self.structured_output
        assert so is not None
        if not (self.running or self.waiting or self.swapped):
            so.wait(self.waiting_for_grammar, GRAMMAR_WAIT_S)
        ready, failed = so.poll(self.waiting_for_grammar)
        for req in ready:
            del self.waiting_for_grammar[req.request_id]
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        for req, why in failed:
            del self.waiting_for_grammar[req.request_id]
            self.num_rejected += 1
            self._request_errors.append((req.request_id, why))
            self._finish(req, RequestStatus.FINISHED_REJECTED)

    def _advance_grammar(self, req: Request, tok: int, status: RequestStatus | None,
                         new_tokens: list[int]) -> RequestStatus | None:
        """Advance the matcher by a newly appended token; a terminated grammar finishes the
        request ("stop"). Jump-forward tokens are appended here, for the next step to compute."""
        so = self.structured_output
        assert so is not None
        if so.accept_token(req, tok):
            return status or RequestStatus.FINISHED_STOPPED
        if status is not None:
            return status
        forced = so.jump_forward_tokens(req)
        for t in forced:
            req.all_token_ids.append(t)
            new_tokens.append(t)
            status = self._check_stop(req, t)
            if status is not None:
                return status  # finishing: the executor never needs them
        if forced:
            self._forced_token_ids.setdefault(req.request_id, []).extend(forced)
        return None

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, why) of requests that failed after admission, since the last call."""
        errors, self._request_errors = self._request_errors, []
        return errors

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.structured_output is not None:
            req.structured_output = None  # frees the matcher
            self._forced_token_ids.pop(req.request_id, None)
        req.status = status
        req.times.finished = self.clock()
        self.kv.free(req)
        del self.requests[req.request_id]
        self.policy.on_finish(req)
        if req.request_id in self._executor_has:
            self._executor_has.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)

    def _metrics(self, req: Request) -> RequestMetrics:
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

    # ================================================================ operator surface
    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; refused (False) while any request holds KV blocks."""
        return self.kv.reset_prefix_cache()

    def defragment(self) -> tuple[list[Move], DefragResult]:
        """A full defragmentation between two steps: the moves (for the executor, which must
        perform them before the next forward pass) and what they achieved."""
        return self.relocator.defragment(self.kv.block_tables())

    def get_stats(self) -> SchedulerStats:
        kv = self.kv
        if not self.requests:
            self.degradation.on_idle()
        step = self._last
        total = step.initial_budget - step.budget
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.waiting_for_grammar),
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
            **lora_stats(self.config.max_loras, self.running, self.waiting),
            num_block_moves_total=self.relocator.num_moves_total,
            num_pinned_blocks=len(kv.pinned),
            degradation_level=self.degradation.level,
            degradation_actions=dict(self.degradation.actions),
        )


_EMPTY: list[int] = []


def _because(reason: str) -> str:
    return f" because {reason}" if reason else ""

