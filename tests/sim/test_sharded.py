"""A run split over worker processes gives the results of the one-process run, bit for bit."""
from __future__ import annotations

import pytest

from llmtower.engine.args import EngineArgs
from llmtower.sim.report import SimResult, build_result
from llmtower.sim.simulator import SimConfig, Simulator
from llmtower.sim.workload_gen import WorkloadSpec, generate


def _trace():
    # Prefix groups (the coordinator's affinity has something to find), priorities and
    # tenants, and a rate that keeps queues and preemptions busy on a small KV cache.
    return generate(WorkloadSpec(num_requests=400, rate=300.0, num_prefix_groups=4,
                                 prefix_len=64, priority_mix="0:1,1:2", tenants="a:1,b:1",
                                 seed=5))


def _run(trace, workers: int, balancer: str, interval: float = 0.0, **engine) -> SimResult:
    cfg = SimConfig(engine=EngineArgs(seed=5, num_gpu_blocks=400, max_num_seqs=32, **engine),
                    num_replicas=5, load_balancer=balancer, workers=workers,
                    routing_interval=interval)
    return build_result(Simulator(cfg).run(trace))


def _same(a: SimResult, b: SimResult) -> None:
    skip = ("wall_s", "sim_requests_per_wall_s")
    assert {k: v for k, v in a.summary.items() if k not in skip} == \
        {k: v for k, v in b.summary.items() if k not in skip}
    assert a.by_priority == b.by_priority and a.by_tenant == b.by_tenant
    assert a.by_replica == b.by_replica
    for k in a.requests:
        assert a.requests[k].tolist() == b.requests[k].tolist(), k
    for k in a.timeline:
        assert a.timeline[k].tolist() == b.timeline[k].tolist(), k


def test_round_robin_over_workers_equals_the_one_process_run():
    trace = _trace()
    one = _run(trace, 1, "round_robin", policy="priority")
    assert one.summary["completed"] == 400 and one.summary["num_preemptions"] > 0
    _same(one, _run(trace, 2, "round_robin", policy="priority"))
    _same(one, _run(trace, 3, "round_robin", policy="priority"))


@pytest.mark.parametrize("balancer", ["coordinator", "least_loaded"])
def test_stateful_routing_in_windows_does_not_depend_on_the_number_of_workers(balancer):
    trace = _trace()
    one = _run(trace, 1, balancer, interval=0.05)
    assert one.summary["completed"] == 400
    _same(one, _run(trace, 2, balancer, interval=0.05))
    # The windows are real: the load spreads, and the snapshot age changes the outcome.
    assert min(r["completed"] for r in one.by_replica) > 40
    instant = _run(trace, 1, balancer)
    assert instant.requests["replica"].tolist() != one.requests["replica"].tolist()


def test_stateful_routing_over_workers_needs_an_interval():
    with pytest.raises(ValueError, match="routing_interval"):
        SimConfig(num_replicas=4, load_balancer="coordinator", workers=2)
    with pytest.raises(ValueError, match="workers=0"):
        SimConfig(num_replicas=4, workers=0)
