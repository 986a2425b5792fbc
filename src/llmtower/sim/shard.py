"""A set of replicas advanced on their virtual clocks: the event loop's per-replica half.

Replicas interact only through the load balancer: between two arrivals, each one's steps depend
on nothing but its own state. So the replicas of a run can be split into shards, each with its
own heap of step boundaries, and a shard that is handed its arrivals in time order, each after
its replicas' steps that end before it (``submit``), evolves exactly as those replicas do in one
heap over the whole cluster (``simulator.py``). ``sharded.py`` runs shards in worker processes.

  submit(arrival at t):  steps ending before t ──▶ replica.pending (taken at its next step)
  run_until(t):          every step boundary before t
  run_to_end():          everything left
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.sim.cluster import Replica
from llmtower.sim.metrics import MetricsCollector
from llmtower.sim.workload import TraceRequest

# The token the simulated executor samples every time; the EOS of requests whose output
# length is hidden (oracle_output_len=False), which may stop only after min_tokens.
SIM_TOKEN = 1


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
                 oracle_output_len: bool, use_priority: bool) -> None:
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

    def next_time(self) -> float:
        return self._heap[0][0] if self._heap else float("inf")

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
        self.num_events += 1
        t, _, ri = heapq.heappop(self._heap)
        rep = self.replicas[ri]
        self._wake[ri] = False
        if rep.in_flight is not None:
            so, mro = rep.in_flight
            rep.in_flight = None
            outs = rep.scheduler.update_from_output(so, mro)
            self.metrics.on_outputs(outs.outputs, t, ri)
        if self._start_step(rep, t):
            heapq.heappush(self._heap, (rep.clock.now, self._seq, ri))
            self._seq += 1

    def _start_step(self, rep: Replica, t: float) -> bool:
        """Take the replica's pending arrivals, schedule and execute one step; False when it
        has nothing it can run (it then idles until its next arrival)."""
        metrics = self.metrics
        rep.clock.advance_to(t)
        sched = rep.scheduler
        if rep.pending:
            for req in rep.pending:
                try:
                    sched.add_request(req)
                except (AdmissionError, QueueFullError) as e:
                    metrics.on_rejected(req.request_id, str(e))
            rep.pending.clear()
        if not sched.requests:
            return False
        so = sched.schedule()
        usage = sched.kv.usage()
        if usage > rep.peak_kv_usage:
            rep.peak_kv_usage = usage
        metrics.on_step(rep.index, t, len(sched.waiting), len(sched.running), len(sched.swapped),
                        usage)
        if so.total_num_scheduled_tokens == 0 and not so.blocks_to_swap_out:
            rep.executor.forget(so.finished_req_ids)
            return False
        rep.in_flight = (so, rep.executor.execute_model(so))
        return True

    def states(self) -> dict[int, ReplicaState]:
        return {i: ReplicaState(r.load, len(r.scheduler.waiting), len(r.scheduler.running),
                                r.scheduler.kv.usage())
                for i, r in self.replicas.items()}

    def totals(self) -> list[ReplicaTotals]:
        return [ReplicaTotals.of(r) for r in self.replicas.values()]


def sampling_params(output_len: int, oracle: bool) -> SamplingParams:
    if oracle:
        return SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    return SamplingParams(max_tokens=None, min_tokens=output_len, temperature=0.0)
