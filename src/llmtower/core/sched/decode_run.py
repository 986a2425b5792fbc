"""Runs of plain decode steps, applied in one pass: what ``k`` rounds of ``schedule()`` and
``update_from_output()`` do when every step is provably the same kind of step.

Between two events that change the batch (an arrival, a request that stops, a preemption) a
decode-only batch repeats one decision: every running request gets one token. Nothing in
``schedule()`` can decide otherwise while

  - nothing waits, is swapped out or waits for its grammar, and no request was added;
  - every running request is a plain decode (one token to compute, no drafts, no
    placeholders, no grammar, no forced tokens) and the batch fits the token budget;
  - no request stops before the run's last step (its token, max_tokens, the length cap),
  - the free blocks cover every block the run's decodes cross into (so nobody is preempted);
  - and nothing else runs per step (no degradation controller, no tenant accounting, no
    block relocator, no sliding window freeing the blocks that leave it).

Within such a run a step's only state changes are: a new KV block where a decode crosses into
one (schedule), a block registered in the prefix cache where a decode fills one (update), one
token appended per request, the counters; and in its last step, requests that stop. ``advance_decode_steps`` applies exactly those, in
the order k separate steps would (step by step; allocations of a step before its
registrations; in batch order within each), so the block ids, the free list, the prefix cache,
every request's tokens and the counters end up identical to the step-by-step run
(tests/core/test_decode_run.py compares them, and tests/sim/test_decode_runs.py a whole
simulation). Its cost is O(requests + blocks crossed) instead of O(requests x steps).

The caller guarantees the executor's side: each request samples ``token_id`` every step and
no drafts are proposed (the simulator's executor does exactly that).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from llmtower.core.outputs import EngineCoreOutput
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.apply_output import _new_output
from llmtower.core.sched.scheduler_state import SchedulerState
from llmtower.core.sched.step import Step
from llmtower.utils import cdiv


@dataclass
class DecodeRun:
    """What the executor and the metrics need of a run of decode steps: the finished requests
    the run's first step reports to the executor, the free KV blocks after each step was
    scheduled (for KV-usage timelines), and the outputs of the requests that stopped in its
    last step (in batch order, as ``update_from_output`` reports them)."""

    finished_req_ids: set[str]
    free_blocks: list[int] = field(default_factory=list)
    stopped: list[EngineCoreOutput] = field(default_factory=list)


class DecodeRunMixin(SchedulerState):
    """Tells how many of the next steps are plain decode steps, and applies them in bulk."""

    def decode_steps_ahead(self, token_id: int, limit: int = 1 << 30) -> int:
        """How many of the next steps (up to ``limit``) are plain decode steps, if no request
        is added and each samples ``token_id``: up to and including the first step in which a
        request stops; 0 when the next step is not one (the conditions: module docstring)."""
        running = self.running
        if (not running or self.waiting or self.swapped or self.waiting_for_grammar
                or self._forced_token_ids or self._request_errors
                or self.policy.charge is not None or self.degradation.config.enabled
                or self.cache_config.kv_allocator == "relocator"
                or self.cache_config.sliding_window is not None):
            return 0
        cfg = self.config
        deg = self.degradation
        n = len(running)
        if n > deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill) or \
                n > deg.max_num_seqs(cfg.max_num_seqs):
            return 0
        k = limit
        max_len = self.max_len
        running_status = RequestStatus.RUNNING
        bs = self.cache_config.block_size
        # With prefix caching every full computed block is registered once a step's outputs
        # are applied; the run relies on it (a lagging one is left to an ordinary step).
        num_cached = self.kv.num_cached_blocks if self.kv.enable_prefix_caching else None
        for req in running:
            num_tokens = len(req.all_token_ids)
            computed = req.num_computed_tokens
            if (num_tokens - computed != 1 or num_tokens <= req.num_prompt_tokens
                    or req.status != running_status or req.num_output_placeholders
                    or req.spec_token_ids or req.structured_output is not None
                    or req.queue_entry or not req.times.first_token
                    or (num_cached is not None
                        and num_cached.get(req.request_id, 0) != computed // bs)):
                return 0
            # The run ends with the first step in which an appended token ends a request.
            num_output = num_tokens - req.num_prompt_tokens
            last = min(req.max_tokens - num_output, max_len - num_tokens)
            sp = req.sampling_params
            if ((token_id == req.eos_token_id and not sp.ignore_eos)
                    or (sp.stop_token_ids and token_id in sp.stop_token_ids)):
                last = min(last, sp.min_tokens - num_output)
            if last < k:
                k = last
                if k <= 0:
                    return 0
        free = self.kv.pool.num_free_blocks
        # (At most one block per request every bs steps, plus one: counted only when tight.)
        if n * (k // bs + 2) > free and self._blocks_needed(k) > free:
            # The largest run whose new blocks fit.
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if self._blocks_needed(mid) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        return k

    def _blocks_needed(self, k: int) -> int:
        """New KV blocks the running decodes take over ``k`` more steps."""
        bs = self.cache_config.block_size
        req_to_blocks = self.kv.req_to_blocks
        need = 0
        for req in self.running:
            more = cdiv(req.num_computed_tokens + k, bs) - len(req_to_blocks[req.request_id])
            if more > 0:
                need += more
        return need

    def advance_decode_steps(self, k: int, token_id: int) -> DecodeRun:
        """Apply ``k`` plain decode steps (``k`` <= ``decode_steps_ahead(token_id)``) as ``k``
        rounds of ``schedule()`` and ``update_from_output()`` with ``token_id`` sampled would;
        the requests' last token time is the clock's now (the end of the run's last step), and
        requests that stop in it are finished as ``update_from_output`` finishes them."""
        assert k >= 1
        kv = self.kv
        bs = self.cache_config.block_size
        caching = kv.enable_prefix_caching
        req_to_blocks = kv.req_to_blocks
        # (step, phase, batch index): a step's allocations (0, while scheduled) come before
        # its registrations in the prefix cache (1, while its outputs are applied).
        events: list[tuple[int, int, int]] = []
        starts = []
        running = self.running
        for i, req in enumerate(running):
            c = req.num_computed_tokens
            starts.append(c)
            # Step s computes the token at position c + s - 1 and needs a new block when that
            # position is past the request's blocks: first at s = blocks * bs - c + 1.
            s = len(req_to_blocks[req.request_id]) * bs - c + 1
            while s <= k:
                events.append((s, 0, i))
                s += bs
            if caching:
                # After step s, c + s tokens are computed, and a block that filled is
                # registered (c // bs are already): at every s where c + s crosses a multiple.
                s = bs - c % bs
                while s <= k:
                    events.append((s, 1, i))
                    s += bs
            req.all_token_ids.extend([token_id] * k)
        events.sort()
        free = kv.pool.num_free_blocks
        run = DecodeRun(self.finished_req_ids)
        self.finished_req_ids = set()
        free_after = run.free_blocks
        last_new: dict[str, list[int]] = {}
        register_last: set[int] = set()  # in the last step: interleaved with the stops below
        step_no = 1
        for s, phase, i in events:
            while step_no < s:
                free_after.append(free)
                step_no += 1
            req = running[i]
            if s == k and phase == 1:
                register_last.add(i)
            elif phase == 0:
                req.num_computed_tokens = starts[i] + s - 1
                new = kv.allocate_slots(req, 1)
                assert new, "decode_steps_ahead promised the run its blocks"
                free -= len(new)
                if s == k:
                    last_new[req.request_id] = [b.block_id for b in new]
            else:
                kv.cache_blocks(req, starts[i] + s)
        while step_no <= k:
            free_after.append(free)
            step_no += 1
        now = self.clock()
        # The last step's outputs, request by request as update_from_output applies them.
        stopped: list[Request] = []
        check_stop = self._check_stop
        max_len = self.max_len
        for i, req in enumerate(running):
            end = req.num_computed_tokens = starts[i] + k
            if i in register_last:
                kv.cache_blocks(req, end)
            req.times.last_token = now
            # _check_stop only where it may say stop (a superset of its conditions).
            num_tokens = end + 1
            if not (num_tokens - req.num_prompt_tokens >= req.max_tokens or num_tokens >= max_len
                    or req.eos_token_id == token_id or req.sampling_params.stop_token_ids):
                continue
            status = check_stop(req, token_id)
            if status is not None:
                out = _new_output(req, [token_id], None, now)
                self._stop(req, status, out, True, stopped)  # type: ignore[attr-defined]
                run.stopped.append(out)
        self.num_steps += k
        self._last = _last_step(running, self, last_new)
        if stopped:
            gone = {r.request_id for r in stopped}
            self.running = [r for r in running if r.request_id not in gone]
        return run


def _last_step(running: list[Request], sched: SchedulerState,
               new_blocks: dict[str, list[int]]) -> Step:
    """The run's last step as ``schedule()`` would have left it (for the statistics)."""
    cfg = sched.config
    deg = sched.degradation
    step = Step(deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill),
                deg.max_num_seqs(cfg.max_num_seqs))
    step.scheduled = dict.fromkeys([r.request_id for r in running], 1)
    step.budget -= len(running)
    step.new_blocks = new_blocks
    return step
