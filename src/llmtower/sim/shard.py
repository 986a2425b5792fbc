"""A set of replicas advanced on their virtual clocks: the event loop's per-replica half.

Replicas interact only through the load balancer: between two arrivals, each one's steps depend
on nothing but its own state. So the replicas of a run can be split into shards, each with its
own heap of step boundaries, and a shard that is handed its arrivals in time order, each after
its replicas' steps that end before it (``submit``), evolves exactly as those replicas do in one
heap over the whole cluster (``simulator.py``). ``sharded.py`` runs shards in worker processes.

  submit(arrival at t):  steps ending before t ──▶ replica.pending (taken at its next step)
  run_until(t):          every step boundary before t
  run_to_end():          everything left

Runs of plain decode steps (``decode_runs``): where the scheduler proves that its next k steps
are plain decodes (``Scheduler.decode_run_ahead``: requests that stop within them leave the
batch, the others go on), the replica plans them at once: their times come from the cost model
in one loop, and one heap entry stands for their end. The step that admits arrivals starts a
run too when everyone in it samples (a prefill among decodes): it is executed as usual, and
its outputs are applied with the run's. Nothing is applied until the run ends or an arrival
(or a state report) cuts it: then the steps that had started by that time are applied in one
pass (``Scheduler.advance_decode_steps``) with their timeline rows, inter-token gaps and the
requests that stopped, and the next step takes the arrival. A cut run and an uncut one apply
the very steps that step-by-step simulation would, so the results are identical either way
(tested). Where the arrivals are known ahead (a sharded run announces each batch it delivers:
``expect``), a run is planned only up to the step its replica's next arrival will cut, so no
step is planned in vain.
"""
from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.outputs import SchedulerOutput
from llmtower.core.request import Request
from llmtower.core.sched.decode_run import DecodeRunShape
from llmtower.core.sampling_params import SamplingParams
from llmtower.sim.cluster import Replica
from llmtower.sim.metrics import MetricsCollector
from llmtower.sim.workload import TraceRequest

# The token the simulated executor samples every time; the EOS of requests whose output
# length is hidden (oracle_output_len=False), which may stop only after min_tokens.
SIM_TOKEN = 1
# A run shorter than this is simulated step by step (planning one costs about a step).
MIN_DECODE_RUN = 2
# Steps planned at once where the next arrival is not announced: a run is planned up to this
# many steps ahead, twice as many after each one that ends uncut (up to MAX_RUN_PLAN), back to
# this after a cut. An arrival cuts a run, and the steps planned past the cut are wasted work;
# a run that ends uncut is followed by the next one at the cost of one more plan.
FIRST_RUN_PLAN = 16
MAX_RUN_PLAN = 4096


@dataclass
class DecodePlan:
    """Owns a replica's planned run of plain decode steps: each step's start, duration and end
    (virtual seconds), the batch size, and the heap entry that stands for the run's end."""

    starts: list[float]
    dts: list[float]
    ends: list[float]
    seq: int
    # The step schedule() returned, executed already, whose outputs the run applies as its
    # first step (None: the run starts between steps).
    in_flight: SchedulerOutput | None = None
    cut: bool = False  # an arrival cut it short
    # Each request's stop step as planned (None once part of the run has been applied).
    lasts: list[int] | None = None


@dataclass
class ReplicaTotals:
    """Owns one replica's end-of-run counters: what the report needs of a replica, small
    enough to send back from a worker process."""

    index: int
    peak_kv_usage: float
    busy_s: float
    num_steps: int
    num_preemptions: int
    num_swap_outs: int
    num_swap_ins: int
    prefix_cache_queries: int
    prefix_cache_hits: int

    @classmethod
    def of(cls, rep: Replica) -> ReplicaTotals:
        s = rep.scheduler
        return cls(rep.index, rep.peak_kv_usage, rep.executor.busy_s, rep.executor.num_steps,
                   s.num_preemptions, s.num_swap_outs, s.num_swap_ins,
                   s.kv.prefix_cache_queries, s.kv.prefix_cache_hits)


@dataclass
class ReplicaState:
    """What a replica reports to the load balancer (the real engine's stats snapshot)."""

    load: int  # requests it owes an answer: pending + inside the scheduler
    waiting: int
    running: int
    kv_usage: float


class ReplicaShard:
    """Owns some replicas of a run (any subset, by global index), the heap of their next step
    boundaries and the metrics of the requests they serve."""

    def __init__(self, replicas: list[Replica], num_replicas: int, max_model_len: int,
                 oracle_output_len: bool, use_priority: bool, decode_runs: bool = True) -> None:
        self.replicas = {r.index: r for r in replicas}
        self.metrics = MetricsCollector(num_replicas)
        self.max_model_len = max_model_len
        self.oracle = oracle_output_len
        self.use_priority = use_priority
        self._params: dict[int, SamplingParams] = {}
        self._heap: list[tuple[float, int, int]] = []  # (time, sequence, replica)
        self._wake = dict.fromkeys(self.replicas, False)  # a step-start event is in the heap
        self._seq = 0
        self.num_events = 0
        # Runs of plain decode steps (module docstring): replica -> its planned run; the heap
        # entries of runs cut short are skipped when they come up.
        self.decode_runs = decode_runs
        self._plans: dict[int, DecodePlan] = {}
        self._stale: set[int] = set()
        self._plan_steps = dict.fromkeys(self.replicas, FIRST_RUN_PLAN)
        # Arrival times announced ahead (``expect``), per replica, in order: a run is planned
        # up to the step that the next one would cut it at, and no further.
        self._upcoming: dict[int, deque[float]] = {i: deque() for i in self.replicas}
        self._min_step_s: float | None = None  # the shortest decode step (_plan_limit)

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

    def expect(self, replica: int, arrival_time: float) -> None:
        """Announce an arrival at ``replica`` that ``submit`` will deliver (in order, after
        those announced before it): plans end where it would cut them."""
        self._upcoming[replica].append(arrival_time)

    def submit(self, tr: TraceRequest, trace_index: int, replica: int,
               token_ids: list[int]) -> None:
        """Deliver an arrival to ``replica`` after the steps that end before it."""
        self.run_until(tr.arrival_time, inclusive=False)
        self.add(tr, trace_index, self.replicas[replica], token_ids)

    def add(self, tr: TraceRequest, trace_index: int, rep: Replica, token_ids: list[int]) -> None:
        """Queue an arrival at ``rep`` now (the caller has run the steps before it)."""
        self.num_events += 1
        sp = self._params.get(tr.output_len)
        if sp is None:
            sp = self._params[tr.output_len] = sampling_params(tr.output_len, self.oracle)
        if not self.oracle and len(token_ids) + tr.output_len > self.max_model_len:
            sp = sampling_params(max(1, self.max_model_len - len(token_ids)), False)
        rep.pending.append(Request(tr.request_id, token_ids, sp,
                                   eos_token_id=None if self.oracle else SIM_TOKEN,
                                   priority=tr.priority if self.use_priority else 0,
                                   arrival_time=tr.arrival_time, tenant=tr.tenant))
        self.metrics.on_submit(tr.request_id, trace_index, tr.arrival_time)
        upcoming = self._upcoming[rep.index]
        if upcoming:
            upcoming.popleft()  # (this one)
        if rep.index in self._plans:
            self._cut(rep, tr.arrival_time)
        if rep.in_flight is None and not self._wake[rep.index]:
            self._wake[rep.index] = True
            heapq.heappush(self._heap, (tr.arrival_time, self._seq, rep.index))
            self._seq += 1

    def run_until(self, t: float, inclusive: bool = False) -> None:
        """Process every step boundary before ``t`` (at ``t`` too if ``inclusive``)."""
        heap = self._heap
        while heap and (heap[0][0] < t or (inclusive and heap[0][0] == t)):
            self.step_next()

    def run_to_end(self) -> None:
        while self._heap:
            self.step_next()

    def step_next(self) -> None:
        """The earliest step boundary: finish the replica's step in flight, start its next."""
        t, seq, ri = heapq.heappop(self._heap)
        if self._stale and seq in self._stale:
            self._stale.discard(seq)  # the end of a run that was cut short
            return
        self.num_events += 1
        rep = self.replicas[ri]
        self._wake[ri] = False
        plan = self._plans.get(ri)
        if plan is not None:
            self._apply_run(rep, len(plan.ends))
            if not plan.cut:
                self._plan_steps[ri] = min(MAX_RUN_PLAN, 2 * self._plan_steps[ri])
        elif rep.in_flight is not None:
            so, mro = rep.in_flight
            rep.in_flight = None
            outs = rep.scheduler.update_from_output(so, mro)
            self.metrics.on_outputs(outs.outputs, t, ri)
        if self._start_step(rep, t):
            self._push(rep.clock.now, ri)

    def _push(self, t: float, ri: int) -> int:
        seq = self._seq
        heapq.heappush(self._heap, (t, seq, ri))
        self._seq += 1
        self._wake[ri] = True
        return seq

    def _start_step(self, rep: Replica, t: float) -> bool:
        """Take the replica's pending arrivals, schedule and execute one step; False when it
        has nothing it can run (it then idles until its next arrival)."""
        metrics = self.metrics
        rep.clock.advance_to(t)
        sched = rep.scheduler
        arrived = bool(rep.pending)
        if arrived:
            for req in rep.pending:
                try:
                    sched.add_request(req)
                except (AdmissionError, QueueFullError) as e:
                    metrics.on_rejected(req.request_id, str(e))
            rep.pending.clear()
        if not sched.requests:
            return False
        if self.decode_runs and not arrived:
            shape = sched.decode_run_ahead(SIM_TOKEN, self._plan_limit(rep))
            if shape.num_steps >= MIN_DECODE_RUN:
                self._plan(rep, shape)
                return False  # the run's end is in the heap
        so = sched.schedule()
        usage = sched.kv.usage()
        if usage > rep.peak_kv_usage:
            rep.peak_kv_usage = usage
        metrics.on_step(rep.index, t, len(sched.waiting), len(sched.running), len(sched.swapped),
                        usage)
        if so.total_num_scheduled_tokens == 0 and not so.blocks_to_swap_out:
            rep.executor.forget(so.finished_req_ids)
            return False
        mro = rep.executor.execute_model(so)
        if self.decode_runs and not sched.waiting:
            # The step that admitted arrivals may be the first of a run (its outputs applied
            # with the run's decode steps).
            shape = sched.decode_run_ahead(SIM_TOKEN, self._plan_limit(rep), so)
            if shape.num_steps >= MIN_DECODE_RUN:
                self._plan(rep, shape, so, t)
                return False
        rep.in_flight = (so, mro)
        return True

    # ------------------------------------------------------------------ decode runs
    def _plan_limit(self, rep: Replica) -> int:
        """Steps to plan ahead: when the replica's next arrival is known, as many as could
        end before it (no decode step is shorter than one of a single request with a context
        of one: the step time grows with each of its counts), the plan then ending at the step
        it will cut; else the adaptive guess."""
        upcoming = self._upcoming[rep.index]
        if not upcoming:
            return self._plan_steps[rep.index]
        if self._min_step_s is None:
            self._min_step_s = rep.executor.cost_model.step_time(1, 1, 1, 1, 1, 0)
        if self._min_step_s <= 0:
            return MAX_RUN_PLAN
        steps = (upcoming[0] - rep.clock.now) / self._min_step_s + 2
        return MAX_RUN_PLAN if steps >= MAX_RUN_PLAN else max(MIN_DECODE_RUN, int(steps))

    def _plan(self, rep: Replica, shape: DecodeRunShape, in_flight: SchedulerOutput | None = None,
              start: float = 0.0) -> None:
        """Plan a run of plain decode steps from the replica's now: their times, step by step
        as the executor would add them to its clock (the same shapes: n tokens, n sampled, a
        context of the requests' computed tokens after the step; a request that stops in a
        step leaves the batch after it). With ``in_flight``, the step executed from ``start``
        to now is the run's first. The plan ends with the step in flight when the replica's
        next announced arrival comes (where that arrival would cut it)."""
        running = rep.scheduler.running
        n = len(running)
        computed = sum(r.num_computed_tokens for r in running)  # before the run's decodes
        stops = shape.stops
        num_stops = len(stops)
        p = 0
        step_time = rep.executor.cost_model.step_time
        starts, dts, ends = [], [], []
        now = rep.clock.now
        first = 1
        offset = 0
        num_steps = shape.num_steps
        upcoming = self._upcoming[rep.index]
        horizon = upcoming[0] if upcoming else float("inf")
        if in_flight is not None:
            starts.append(start)
            dts.append(rep.executor.last_step_s)
            ends.append(now)
            while p < num_stops and stops[p][0] == 1:
                n -= 1
                computed -= stops[p][1]
                p += 1
            first = 2
            offset = 1
            if now >= horizon:
                num_steps = 1
        for s in range(first, num_steps + 1):
            ctx = computed + (s - offset) * n
            dt = step_time(n, n, ctx, ctx, n, 0)
            starts.append(now)
            dts.append(dt)
            now += dt
            ends.append(now)
            if now >= horizon:
                break
            while p < num_stops and stops[p][0] == s:
                n -= 1
                computed -= stops[p][1]
                p += 1
        plan = self._plans[rep.index] = DecodePlan(starts, dts, ends, -1, in_flight,
                                                   lasts=shape.lasts or None)
        plan.seq = self._push(now, rep.index)

    def _cut(self, rep: Replica, t: float) -> None:
        """An arrival at ``t``: the run ends with the step in flight at ``t`` (every boundary
        before ``t`` is processed by now); its steps are applied when that step ends, as step
        by step, and the next step, which takes the arrival, starts then."""
        plan = self._plans[rep.index]
        self._plan_steps[rep.index] = FIRST_RUN_PLAN
        plan.cut = True
        k = len(plan.ends)
        j = 1 + bisect_left(plan.ends, t, 0, k - 1)
        if j < k:
            self._stale.add(plan.seq)
            del plan.starts[j:], plan.dts[j:], plan.ends[j:]
            plan.seq = self._push(plan.ends[-1], rep.index)

    def _apply_run(self, rep: Replica, j: int) -> None:
        """Apply the first ``j`` steps of the replica's planned run, with what each would have
        recorded: the executor's counters and clock, the timeline rows, the gaps, the
        requests that stopped."""
        ri = rep.index
        plan = self._plans.pop(ri)
        sched = rep.scheduler
        ex = rep.executor
        ends = plan.ends[:j]
        rep.clock.now = ends[-1]
        n = len(sched.running)
        run = sched.advance_decode_steps(j, SIM_TOKEN, ends, plan.in_flight, plan.lasts)
        if run.finished_req_ids:
            ex.forget(run.finished_req_ids)
        stop_steps = run.stop_steps
        if stop_steps:  # requests in each step: those that stop leave after their step
            alive = []
            p = 0
            for s in range(1, j + 1):
                alive.append(n)
                while p < len(stop_steps) and stop_steps[p] == s:
                    n -= 1
                    p += 1
        else:
            alive = [n] * j
        # The first step in flight was counted and recorded when it was executed.
        first = 0 if plan.in_flight is None else 1
        num_blocks = sched.kv.pool.num_blocks
        usages = [1.0 - f / num_blocks for f in run.free_blocks[first:j]]
        if usages:
            peak = max(usages)
            if peak > rep.peak_kv_usage:
                rep.peak_kv_usage = peak
            busy = ex.busy_s
            for dt in plan.dts[first:j]:  # (added one by one, as the executor does)
                busy += dt
            ex.busy_s = busy
            ex.num_steps += j - first
            self.metrics.on_steps(ri, plan.starts[first:j], alive[first:], usages)
        metrics = self.metrics
        ex.last_step_s = plan.dts[j - 1]
        metrics.on_decode_steps(run.request_ids, ends, alive)
        for out, s in zip(run.stopped, stop_steps):
            metrics.on_finished(out, ends[s - 1], ri)
        self.num_events += j - 1  # the boundaries between its steps

    def states(self, at: float | None = None) -> dict[int, ReplicaState]:
        """Every replica's state at ``at`` (the steps before it processed already)."""
        return {i: (self._state_in_run(r, at) if at is not None and i in self._plans else
                    ReplicaState(r.load, len(r.scheduler.waiting), len(r.scheduler.running),
                                 r.scheduler.kv.usage()))
                for i, r in self.replicas.items()}

    def _state_in_run(self, rep: Replica, at: float) -> ReplicaState:
        """The state a report at ``at`` reads in the middle of a run, as step by step: the
        steps that ended before ``at`` applied, the one in flight at ``at`` scheduled (its new
        blocks taken) but its outputs not applied yet (nobody stopped in it yet)."""
        plan = self._plans[rep.index]
        k = len(plan.ends)
        m = bisect_left(plan.ends, at, 0, k - 1)  # steps ended before it; step m + 1 in flight
        scheduled = m == 0 and plan.in_flight is not None  # (executed by the real schedule())
        if m:  # the steps that ended before it are applied; the rest stays planned
            ri = rep.index
            self._stale.add(plan.seq)
            self._apply_run(rep, m)
            rest = self._plans[ri] = DecodePlan(plan.starts[m:], plan.dts[m:], plan.ends[m:], -1)
            rest.seq = self._push(rest.ends[-1], ri)
        sched = rep.scheduler
        kv = sched.kv
        free = kv.pool.num_free_blocks
        if not scheduled:  # the decode step in flight takes a block where one is full
            bs = kv.block_size
            req_to_blocks = kv.req_to_blocks
            for r in sched.running:
                if r.num_computed_tokens >= len(req_to_blocks[r.request_id]) * bs:
                    free -= 1
        return ReplicaState(rep.load, len(sched.waiting), len(sched.running),
                            1.0 - free / kv.pool.num_blocks)

    def totals(self) -> list[ReplicaTotals]:
        return [ReplicaTotals.of(r) for r in self.replicas.values()]


def sampling_params(output_len: int, oracle: bool) -> SamplingParams:
    if oracle:
        return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return SamplingParams(max_tokens=None, min_tokens=output_len, temperature=0.0)
