"""Runs of plain decode steps applied in one pass (sim/shard.py, core/sched/decode_run.py)
give the results of simulating every step one by one, bit for bit."""
from __future__ import annotations

import pytest

from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.args import EngineArgs
from llmtower.sim.report import SimResult, build_result
from llmtower.sim.simulator import SimConfig, Simulator
from llmtower.sim.workload_gen import WorkloadSpec, generate
from tests.sim.test_sharded import _same


def _trace():
    # As test_sharded's: prefix groups, priorities, tenants, busy queues on a small KV cache.
    return generate(WorkloadSpec(num_requests=200, rate=300.0, num_prefix_groups=4,
                                 prefix_len=64, priority_mix="0:1,1:2", tenants="a:1,b:1",
                                 seed=5))


def _run(trace, decode_runs: bool, balancer: str = "round_robin", workers: int = 1,
         interval: float = 0.0, **engine) -> SimResult:
    cfg = SimConfig(engine=EngineArgs(seed=5, num_gpu_blocks=400, max_num_seqs=32, **engine),
                    num_replicas=5, load_balancer=balancer, workers=workers,
                    routing_interval=interval, decode_runs=decode_runs)
    return build_result(Simulator(cfg).run(trace))


@pytest.fixture
def runs_applied(monkeypatch):
    """Counts the decode steps applied in runs (in this process)."""
    count = [0]
    orig = Scheduler.advance_decode_steps

    def counted(self, k, token_id, *args):
        count[0] += k
        return orig(self, k, token_id, *args)

    monkeypatch.setattr(Scheduler, "advance_decode_steps", counted)
    return count


@pytest.mark.parametrize("engine", [
    dict(policy="priority"),  # preemptions by priority, prefix hits on re-admission
    dict(policy="fcfs", enable_prefix_caching=False),
    dict(policy="sjf", preemption_mode="swap", swap_space="1GiB"),
], ids=["priority", "no-prefix-cache", "sjf-swap"])
def test_runs_of_decode_steps_change_nothing(engine, runs_applied):
    trace = _trace()
    stepwise = _run(trace, False, **engine)
    assert runs_applied[0] == 0
    bulk = _run(trace, True, **engine)
    # Every per-request column, every timeline row and every summary figure (ITL included) is
    # the same, with a good share of the steps applied in runs (this workload keeps queues
    # busy, so most steps admit someone).
    assert stepwise.summary["completed"] == 200
    _same(stepwise, bulk)
    assert runs_applied[0] > stepwise.summary["num_steps"] / 10, runs_applied[0]


def test_runs_cut_by_state_reports_change_nothing(runs_applied):
    trace = _trace()
    stepwise = _run(trace, False, "coordinator", interval=0.05)
    bulk = _run(trace, True, "coordinator", interval=0.05)
    assert runs_applied[0] > 0
    _same(stepwise, bulk)


def test_runs_that_admit_and_finish_requests_uncut_change_nothing(runs_applied):
    """Sparse arrivals and short outputs: runs that start at the step admitting a request go
    uncut to its last token (its first token's time is that step's end), and past the stops
    of the others."""
    trace = generate(WorkloadSpec(num_requests=40, rate=2.0, input_len="uniform:8-64",
                                  output_len="uniform:1-40", seed=6))
    stepwise = _run(trace, False)
    bulk = _run(trace, True)
    assert runs_applied[0] > stepwise.summary["num_steps"] / 2, runs_applied[0]
    _same(stepwise, bulk)


@pytest.mark.parametrize("interval", [0.013, 0.05])
def test_state_reports_inside_runs_read_the_step_in_flight(interval, runs_applied):
    """A report in the middle of a run reads the state between the step in flight's schedule
    and its outputs (requests that stop in it still running, its new blocks taken), and an
    arrival does not apply that step before its end: the routing, hence everything, is the
    same as step by step (short outputs: many stops inside runs)."""
    trace = generate(WorkloadSpec(num_requests=150, rate=200.0, input_len="uniform:8-200",
                                  output_len="uniform:1-60", seed=1))
    res = []
    for runs in (False, True):
        cfg = SimConfig(engine=EngineArgs(seed=5, num_gpu_blocks=300, max_num_seqs=32),
                        num_replicas=3, load_balancer="coordinator", routing_interval=interval,
                        decode_runs=runs)
        res.append(build_result(Simulator(cfg).run(trace)))
    assert runs_applied[0] > 0
    _same(*res)


def test_runs_end_where_the_next_announced_arrival_cuts_them(runs_applied, monkeypatch):
    """A sharded run announces each shard's arrivals ahead (``ReplicaShard.expect``): a run is
    planned up to the step in flight at its replica's next arrival and no further, so every
    step planned is applied (none is planned past a cut), with the same results as one
    process without announcements."""
    from llmtower.sim.shard import ReplicaShard
    planned = [0]
    orig = ReplicaShard._plan

    def counted(self, rep, *args):
        orig(self, rep, *args)
        planned[0] += len(self._plans[rep.index].ends)

    monkeypatch.setattr(ReplicaShard, "_plan", counted)
    trace = _trace()
    # (round_robin reads no state: routing_interval only sends the run through the shards.)
    sharded = _run(trace, True, workers=1, interval=0.5)
    assert runs_applied[0] > 0 and planned[0] == runs_applied[0]
    planned[0] = runs_applied[0] = 0
    one = _run(trace, True)
    assert planned[0] > runs_applied[0]  # without announcements, steps planned past cuts
    _same(one, sharded)
