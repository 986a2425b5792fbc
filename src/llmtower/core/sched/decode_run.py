"""Runs of plain decode steps, applied in one pass: what ``k`` rounds of ``schedule()`` and
``update_from_output()`` do when every step is provably the same kind of step.

Between two arrivals a decode-only batch repeats one decision: every running request gets
one token. Nothing in ``schedule()`` can decide otherwise while

  - nothing waits, is swapped out or waits for its grammar, and no request was added;
  - every running request is a plain decode (one token to compute, no drafts, no
    placeholders, no grammar, no forced tokens) and the batch fits the token budget;
  - the free blocks cover every block the run's decodes cross into (so nobody is preempted);
  - and nothing else runs per step (no degradation controller, no tenant accounting, no
    block relocator, no sliding window freeing the blocks that leave it).

A request that stops (its token, max_tokens, the length cap) only leaves the batch: the others
go on decoding. ``decode_steps_ahead`` ends a run at the first such step; ``decode_run_ahead``
goes on past them, and may start from the step ``schedule()`` has just returned (in flight:
typically one that admits a new prompt among the decodes, in which every request samples).

Within such a run a step's only state changes are: a new KV block where a decode crosses into
one (schedule), a block registered in the prefix cache where a decode fills one (update), one
token appended per request, the requests that stop (finished as update_from_output finishes
them: blocks freed, outputs reported), the counters. ``advance_decode_steps`` applies exactly
those, in the order k separate steps would (step by step; allocations of a step before its
outputs; in batch order within each, a request's registration before its stop), so the block
ids, the free list, the prefix cache, every request's tokens and times and the counters end up
identical to the step-by-step run (tests/core/sched/test_decode_run.py compares them, and
tests/sim/test_decode_runs.py whole simulations). Its cost is O(requests + blocks crossed +
stops) instead of O(requests x steps).

The caller guarantees the executor's side: each request samples ``token_id`` every step, no
drafts are proposed and no logprobs asked for (the simulator's executor does exactly that).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from llmtower.core.outputs import EngineCoreOutput, SchedulerOutput
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.apply_output import _new_output
from llmtower.core.sched.scheduler_state import SchedulerState
from llmtower.core.sched.step import Step
from llmtower.utils import cdiv


@dataclass
class DecodeRun:
    """What the executor and the metrics need of a run of decode steps: the finished requests
    the run's steps report to the executor (those that finished before it, and those that
    stopped in any step but its last), the free KV blocks after each step was scheduled (for
    KV-usage timelines), and the outputs of the requests that stopped (in step order, batch
    order within a step, as ``update_from_output`` reports them) with each one's step (1-based)."""

    finished_req_ids: set[str]
    free_blocks: list[int] = field(default_factory=list)
    stopped: list[EngineCoreOutput] = field(default_factory=list)
    stop_steps: list[int] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # the first step's batch, in order


@dataclass
class DecodeRunShape:
    """A run of plain decode steps as planned: its length, and for every request that stops
    within it, the step it stops in and its computed tokens before the run (sorted by step):
    what the step times of the run depend on."""

    num_steps: int
    stops: list[tuple[int, int]] = field(default_factory=list)
    # Each running request's stop step (in ``running`` order; past ``num_steps``: it does
    # not stop in the run), for ``advance_decode_steps`` to apply the run without asking again.
    lasts: list[int] = field(default_factory=list)


class DecodeRunMixin(SchedulerState):
    """Tells how many of the next steps are plain decode steps, and applies them in bulk."""

    def decode_steps_ahead(self, token_id: int, limit: int = 1 << 30) -> int:
        """How many of the next steps (up to ``limit``) are plain decode steps, if no request
        is added and each samples ``token_id``: up to and including the first step in which a
        request stops; 0 when the next step is not one (the conditions: module docstring)."""
        return self._decode_run(token_id, limit, False).num_steps

    def decode_run_ahead(self, token_id: int, limit: int = 1 << 30,
                         in_flight: SchedulerOutput | None = None) -> DecodeRunShape:
        """Like ``decode_steps_ahead``, but the run goes on past the steps in which requests
        stop (the others keep decoding, as they would step by step) until the batch empties,
        ``limit`` or the free blocks end it; with the stops it contains.

        ``in_flight``: the step ``schedule()`` just returned, whose outputs are not applied
        yet, is the run's first step (any step in which every request of the batch samples:
        a new prompt's prefill among decodes, typically); the rest are plain decodes."""
        return self._decode_run(token_id, limit, True, in_flight)

    def _decode_run(self, token_id: int, limit: int, past_stops: bool,
                    in_flight: SchedulerOutput | None = None) -> DecodeRunShape:
        running = self.running
        if (not running or self.waiting or self.swapped or self.waiting_for_grammar
                or self._forced_token_ids or self._request_errors
                or self.policy.charge is not None or self.degradation.config.enabled
                or self.cache_config.kv_allocator == "relocator"
                or self.cache_config.sliding_window is not None):
            return _NO_RUN
        cfg = self.config
        deg = self.degradation
        n = len(running)
        if n > deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill) or \
                n > deg.max_num_seqs(cfg.max_num_seqs):
            return _NO_RUN
        # Tokens known but not computed per request: 1 between steps, 0 while a step in
        # which each request samples is in flight.
        pending = 1
        scheduled: dict[str, int] = {}
        if in_flight is not None:
            scheduled = in_flight.num_scheduled_tokens
            if (len(scheduled) != n or in_flight.scheduled_spec_decode_tokens
                    or in_flight.blocks_to_swap_in or in_flight.blocks_to_swap_out
                    or in_flight.blocks_to_move):
                return _NO_RUN
            pending = 0
        k = limit
        longest = 0
        lasts: list[int] = []
        max_len = self.max_len
        running_status = RequestStatus.RUNNING
        bs = self.cache_config.block_size
        # With prefix caching every full computed block is registered once a step's outputs
        # are applied; the run relies on it (a lagging one is left to an ordinary step).
        # (In flight, the step's outputs register every full block: update_from_output.)
        num_cached = (self.kv.num_cached_blocks
                      if self.kv.enable_prefix_caching and pending else None)
        for req in running:
            num_tokens = len(req.all_token_ids)
            computed = req.num_computed_tokens
            if (num_tokens - computed != pending
                    or req.status != running_status or req.num_output_placeholders
                    or req.spec_token_ids or req.structured_output is not None
                    or req.queue_entry
                    or (pending and (num_tokens <= req.num_prompt_tokens
                                     or not req.times.first_token))
                    or (not pending and req.request_id not in scheduled)
                    or (num_cached is not None
                        and num_cached.get(req.request_id, 0) != computed // bs)):
                return _NO_RUN
            # The step of the run in which it stops: the first whose token ends it.
            last = _stop_step(req, num_tokens, token_id, max_len)
            if last <= 0:
                return _NO_RUN
            if past_stops:
                lasts.append(last)
                if last > longest:
                    longest = last
            elif last < k:
                k = last
        if past_stops and longest < k:
            k = longest
        free = self.kv.pool.num_free_blocks
        # (At most one block per request every bs steps, plus one: counted only when tight.
        # Blocks that stopping requests free are not counted: the run is shorter, never wrong.)
        if n * (k // bs + 2) > free and self._blocks_needed(k, lasts, 1 - pending) > free:
            # The largest run whose new blocks fit.
            lo, hi = 0, k
            while lo < hi:
                mid = (lo + hi + 1) >> 1
                if self._blocks_needed(mid, lasts, 1 - pending) <= free:
                    lo = mid
                else:
                    hi = mid - 1
            k = lo
        if not past_stops or k == 0:
            return DecodeRunShape(k)
        stops = sorted((last, req.num_computed_tokens)
                       for last, req in zip(lasts, running) if last <= k)
        return DecodeRunShape(k, stops, lasts)

    def _blocks_needed(self, k: int, lasts: list[int], in_flight: int = 0) -> int:
        """New KV blocks the running decodes take over ``k`` more steps (each only up to its
        last step, where ``lasts`` gives them; the first ``in_flight`` step is scheduled)."""
        bs = self.cache_config.block_size
        req_to_blocks = self.kv.req_to_blocks
        need = 0
        for i, req in enumerate(self.running):
            steps = (k if not lasts or lasts[i] > k else lasts[i]) - in_flight
            more = cdiv(req.num_computed_tokens + steps, bs) - len(req_to_blocks[req.request_id])
            if more > 0:
                need += more
        return need

    def advance_decode_steps(self, k: int, token_id: int,
                             step_ends: Sequence[float] | None = None,
                             in_flight: SchedulerOutput | None = None,
                             lasts: list[int] | None = None) -> DecodeRun:
        """Apply ``k`` plain decode steps (``k`` <= the ``num_steps`` of ``decode_run_ahead``)
        as ``k`` rounds of ``schedule()`` and ``update_from_output()`` with ``token_id`` sampled
        would: requests that stop within them are finished as ``update_from_output`` finishes
        them, the others decode on. Step s ends at ``step_ends[s - 1]`` (default: the clock's
        now, for every step: then only the last step may stop requests). With ``in_flight``
        (as planned by ``decode_run_ahead``) the first step is that one: scheduled already,
        its outputs are applied here (every request samples ``token_id``; no logprobs).
        ``lasts``: the ``lasts`` of that plan, when nothing has changed since it was made."""
        assert k >= 1
        assert in_flight is None or step_ends is not None, "a step in flight needs its end"
        kv = self.kv
        pool = kv.pool
        bs = self.cache_config.block_size
        caching = kv.enable_prefix_caching
        req_to_blocks = kv.req_to_blocks
        max_len = self.max_len
        now = self.clock()
        end = now if step_ends is None else step_ends[k - 1]
        # Steps already scheduled (allocated): the first, when it is in flight.
        done = 0 if in_flight is None else 1
        # (step, phase, code): a step's allocations (phase 0, code = batch index i, while
        # scheduled) come before its outputs (phase 1, in batch order: code 2i registers a
        # block that filled in the prefix cache, 2i + 1 stops the request), as
        # update_from_output applies them: a request's registration before its stop.
        events: list[tuple[int, int, int]] = []
        running = self.running
        request_ids = [r.request_id for r in running]
        # Step s computes the token at position base + s - 1 (for s > done).
        bases = [r.num_computed_tokens - done for r in running]
        if lasts is None:  # the step in which each stops (as in _decode_run)
            lasts = [_stop_step(r, len(r.all_token_ids), token_id, max_len) for r in running]
        else:
            assert len(lasts) == len(running), "lasts of another batch"
        run = DecodeRun(self.finished_req_ids, request_ids=request_ids)
        self.finished_req_ids = set()
        num_stops = 0
        tail = [token_id] * k
        hash_full_blocks = kv.hash_full_blocks
        for i, (req, rid, base, last) in enumerate(zip(running, request_ids, bases, lasts)):
            stops = last <= k
            if stops:
                events.append((last, 1, i + i + 1))
                num_stops += 1
            else:
                last = k
            # A new block where that position is past the request's blocks.
            s = len(req_to_blocks[rid]) * bs - base + 1
            while s <= last:
                events.append((s, 0, i))
                s += bs
            req.all_token_ids.extend(tail if last == k else tail[:last])
            if caching:
                # After step s, base + s tokens are computed, and a block that filled is
                # registered: at every s where base + s crosses a multiple of bs. Their
                # hashes are computed now, in one pass (cache_blocks then finds them).
                s = bs - base % bs
                if s <= last:
                    hash_full_blocks(req, base + last)
                    while s <= last:
                        events.append((s, 1, i + i))
                        s += bs
            times = req.times
            if not times.first_token and not (stops and last == 1):
                # In flight: a prefill's first token (one that ends it gets it as it stops).
                times.first_token = end if step_ends is None else step_ends[0]
            if stops:
                continue  # its count and last token time are set when it stops
            req.num_computed_tokens = base + k
            times.last_token = end
        events.sort()
        allocate_one = pool.allocate_one
        free_after = run.free_blocks
        last_new: dict[str, list[int]] = {}
        stopped: list[Request] = []
        check_stop = self._check_stop
        step_no = 1
        for s, phase, i in events:
            while step_no < s:  # the steps before s: their allocations are all done
                free_after.append(pool.num_free_blocks)
                step_no += 1
            if phase == 0:
                # What kv.allocate_slots(req, 1) does for a decode crossing into a new block
                # (no window, no hits); decode_run_ahead promised the run its free blocks.
                rid = request_ids[i]
                block = allocate_one()
                req_to_blocks[rid].append(block)
                if s == k:
                    last_new[rid] = [block.block_id]
                continue
            if step_no == s:  # step s's outputs: its allocations are all done
                free_after.append(pool.num_free_blocks)
                step_no += 1
            req = running[i >> 1]
            if not i & 1:
                kv.cache_next_block(req, bases[i >> 1] + s)
                continue
            # The request stops in step s: its last token, then finished at the step's end.
            assert s == k or step_ends is not None, "stops before the last step need step_ends"
            req.num_computed_tokens = bases[i >> 1] + s
            t = now if step_ends is None else step_ends[s - 1]
            status = check_stop(req, token_id)
            assert status is not None, "decode_run_ahead promised this stop"
            out = _new_output(req, [token_id], None, t)
            self._stop(req, status, out, True, stopped, t)  # type: ignore[attr-defined]
            run.stopped.append(out)
            run.stop_steps.append(s)
            if s < k and req.request_id in self.finished_req_ids:
                # The next step's schedule() reports it to the executor (within the run).
                self.finished_req_ids.discard(req.request_id)
                run.finished_req_ids.add(req.request_id)
        while step_no <= k:
            free_after.append(pool.num_free_blocks)
            step_no += 1
        self.num_steps += k - done
        if k > done:  # (else the step in flight is the last one schedule() made)
            self._last = _last_step(
                [rid for rid, last in zip(request_ids, lasts) if last >= k]
                if num_stops else request_ids, self, last_new)
        if stopped:
            gone = {r.request_id for r in stopped}
            self.running = [r for r in running if r.request_id not in gone]
        return run


_NO_RUN = DecodeRunShape(0)


def _last_step(request_ids: list[str], sched: SchedulerState,
               new_blocks: dict[str, list[int]]) -> Step:
    """The run's last step as ``schedule()`` would have left it (for the statistics): the
    requests it scheduled (one token each) and their new blocks."""
    cfg = sched.config
    deg = sched.degradation
    step = Step(deg.token_budget(cfg.max_num_batched_tokens, cfg.enable_chunked_prefill),
                deg.max_num_seqs(cfg.max_num_seqs))
    step.scheduled = dict.fromkeys(request_ids, 1)
    step.budget -= len(request_ids)
    step.new_blocks = new_blocks
    return step


def _stop_step(req: Request, num_tokens: int, token_id: int, max_len: int) -> int:
    """The step of a run (1 = the next) in which ``req``, holding ``num_tokens`` tokens and
    sampling ``token_id`` at every step, stops: ``_check_stop``'s conditions (max_tokens, the
    length cap, its EOS or a stop token once min_tokens are out); <= 0 where it cannot run."""
    num_output = num_tokens - req.num_prompt_tokens
    last = req.max_tokens - num_output
    if max_len - num_tokens < last:
        last = max_len - num_tokens
    sp = req.sampling_params
    if ((token_id == req.eos_token_id and not sp.ignore_eos)
            or (sp.stop_token_ids and token_id in sp.stop_token_ids)):
        last = min(last, sp.min_tokens - num_output)
    return last
