"""The discrete-event simulation around the real Scheduler: determinism, policies,
preemption, prefix caching, replicas and the executor interface."""
from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import simulate

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import EngineCoreRequest
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.sim.cost_model import CostModel
from llmtower.sim.metrics import SLO
from llmtower.sim.profiles import load_device, load_model
from llmtower.sim.sim_executor import SimExecutor
from llmtower.sim.workload import TraceRequest
from llmtower.sim.workload_gen import WorkloadSpec, generate


def workload(n=300, rate=40.0, **kw):
    return generate(WorkloadSpec(num_requests=n, rate=rate, **kw))


def test_identical_seeds_give_identical_results():
    kw = dict(priority_mix="0:1,1:2", tenants="a:1,b:1", num_prefix_groups=4, prefix_len=64, seed=3)
    runs = [simulate(workload(**kw), num_replicas=2, load_balancer="least_loaded",
                     num_gpu_blocks=600, seed=3) for _ in range(2)]
    a, b = runs
    for key in ("summary", "by_priority", "by_tenant", "by_replica"):
        x, y = getattr(a, key), getattr(b, key)
        if key == "summary":
            x = {k: v for k, v in x.items() if k not in ("wall_s", "sim_requests_per_wall_s")}
            y = {k: v for k, v in y.items() if k not in ("wall_s", "sim_requests_per_wall_s")}
        assert x == y
    for col in a.requests:
        assert np.array_equal(a.requests[col], b.requests[col])
    assert a.summary["num_preemptions"] > 0  # the runs exercised preemption, not just decode


def test_every_request_produces_exactly_its_trace_output_len():
    trace = workload(200, output_len="uniform:1-40")
    res = simulate(trace)
    assert res.summary["completed"] == 200 and res.summary["unfinished"] == 0
    by_index = dict(zip(res.requests["index"].tolist(), res.requests["output_tokens"].tolist()))
    assert by_index == {i: r.output_len for i, r in enumerate(trace)}


def test_priority_beats_fcfs_on_the_high_priority_class_p99_ttft_under_overload():
    # About 2x what one H100 sustains with at most 32 requests running.
    trace = workload(600, rate=60.0, priority_mix="0:1,1:3", seed=1)
    fcfs = simulate(trace, max_num_seqs=32, policy="fcfs")
    prio = simulate(trace, max_num_seqs=32, policy="priority")
    assert fcfs.summary["completed"] == prio.summary["completed"] == 600
    high_fcfs = fcfs.by_priority["0"]["ttft_ms"]["p99"]
    high_prio = prio.by_priority["0"]["ttft_ms"]["p99"]
    assert high_prio < high_fcfs / 10
    # Under FCFS both classes wait alike: priorities are not passed to a non-priority policy.
    assert fcfs.by_priority["1"]["ttft_ms"]["p99"] == pytest.approx(high_fcfs, rel=0.3)


def test_kv_pressure_preempts_by_recompute_or_by_swap():
    trace = workload(120, rate=100.0, input_len="uniform:200-400", output_len="uniform:100-200")
    rec = simulate(trace, num_gpu_blocks=200, preemption_mode="recompute")
    swp = simulate(trace, num_gpu_blocks=200, preemption_mode="swap", swap_space="4GiB")
    assert rec.summary["completed"] == swp.summary["completed"] == 120
    assert rec.summary["num_preemptions"] > 0 and rec.summary["num_swap_outs"] == 0
    assert swp.summary["num_swap_outs"] > 0
    assert rec.summary["peak_kv_usage"] == pytest.approx(1.0, abs=0.05)


def test_shared_prefixes_hit_the_prefix_cache():
    shared = workload(100, num_prefix_groups=2, prefix_len=512)
    alone = workload(100)
    assert simulate(shared).summary["prefix_cache_hit_rate"] > 0.5
    assert simulate(alone).summary["prefix_cache_hit_rate"] == 0.0
    assert simulate(shared, enable_prefix_caching=False).summary["prefix_cache_hit_rate"] == 0.0


def test_prefix_hits_make_prefill_cheaper():
    trace = workload(100, rate=5.0, num_prefix_groups=1, prefix_len=1024, input_len="16")
    on = simulate(trace, enable_prefix_caching=True)
    off = simulate(trace, enable_prefix_caching=False)
    assert on.summary["ttft_ms"]["mean"] < 0.5 * off.summary["ttft_ms"]["mean"]


def test_replicas_share_the_load():
    trace = workload(400, rate=200.0)
    one = simulate(trace, max_num_seqs=16)
    four = simulate(trace, max_num_seqs=16, num_replicas=4)
    rr = [r["completed"] for r in four.by_replica]
    assert rr == [100, 100, 100, 100]
    assert four.summary["duration_s"] < one.summary["duration_s"] / 2
    ll = simulate(trace, max_num_seqs=16, num_replicas=4, load_balancer="least_loaded")
    assert sum(r["completed"] for r in ll.by_replica) == 400
    assert min(r["completed"] for r in ll.by_replica) > 60


def test_requests_that_can_never_run_are_reported_as_rejected():
    trace = [TraceRequest(0.0, 100, 10, request_id="ok"),
             TraceRequest(0.0, 9000, 10, request_id="too-long")]
    res = simulate(trace, max_model_len=4096)
    assert res.summary["completed"] == 1 and res.summary["rejected"] == 1


def test_goodput_counts_requests_meeting_every_slo():
    trace = workload(200, rate=40.0)
    loose = simulate(trace, slo=SLO(ttft_ms=1e6, tpot_ms=1e6))
    tight = simulate(trace, slo=SLO(ttft_ms=0.001))
    assert loose.summary["slo_attainment"] == 1.0
    assert loose.summary["goodput_req_s"] == pytest.approx(loose.summary["request_throughput"])
    assert tight.summary["goodput_req_s"] == 0.0


def test_the_sim_executor_runs_inside_a_real_engine_core():
    cm = CostModel(load_model("llama-3-8b"), load_device("h100"), block_size=16)
    ex = SimExecutor(cm)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), CacheConfig(num_blocks=64),
                      clock=ex.clock)
    engine = EngineCore(sched, ex)
    for i, n in enumerate((100, 30, 5)):  # 100 tokens > the budget: a chunked prefill
        engine.add_request(EngineCoreRequest(str(i), list(range(n)), SamplingParams(
            max_tokens=4 + i, ignore_eos=True), eos_token_id=0, arrival_time=1e-9))
    got: dict[str, int] = {}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
    assert got == {"0": 4, "1": 5, "2": 6}
    assert ex.clock.now == pytest.approx(ex.busy_s) and ex.num_steps >= 7
