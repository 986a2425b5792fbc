"""Regression tests of scheduler bugs found from outside (issue 10); each failed before its fix."""
from __future__ import annotations

from sched_helpers import assert_all_free, make_engine, make_request, run_to_completion
from llmtower.core.outputs import ModelRunnerOutput
from llmtower.core.request import RequestStatus


def step(engine):
    so = engine.scheduler.schedule()
    engine.scheduler.update_from_output(so, engine.executor.execute_model(so))
    return so


# ---------------------------------------------------------------- 1. request id reuse
def test_reused_id_after_abort_schedules_the_new_request():
    e = make_engine()
    s = e.scheduler
    s.add_request(make_request("x", [1, 2, 3]))
    s.abort_requests(["x"])
    new = make_request("x", [1, 2, 3, 4], max_tokens=2, ignore_eos=True)
    s.add_request(new)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"x": 4}
    assert so.scheduled_new_reqs[0].prompt_token_ids == [1, 2, 3, 4]
    assert len(s.waiting) == 0 and s.waiting.num_tokens == 0 and new.status == RequestStatus.RUNNING
    s.update_from_output(so, e.executor.execute_model(so))
    out = run_to_completion(e)
    assert len(out["x"]) == 1 and run_to_completion.finish["x"] == "length"
    assert_all_free(e)


def test_reused_id_after_abort_of_a_running_request_in_flight():
    """The old request's output, late because its step was in flight, must not reach the new one."""
    e = make_engine()
    s = e.scheduler
    s.add_request(make_request("x", [5, 6, 7], max_tokens=4, ignore_eos=True))
    so_old = s.schedule()
    mro_old = e.executor.execute_model(so_old)
    s.abort_requests(["x"])
    s.add_request(make_request("x", [1, 2, 3, 4], max_tokens=4, ignore_eos=True))
    outs = s.update_from_output(so_old, mro_old).outputs
    assert outs == [] and s.requests["x"].num_tokens == 4
    run_to_completion(e)
    assert_all_free(e)


# ---------------------------------------------------------------- 2. step statistics
def test_preempting_a_request_scheduled_this_step_keeps_token_counts_exact():
    e = make_engine(block_size=4, num_blocks=5, policy="priority", long_prefill_token_threshold=4,
                    enable_prefix_caching=False)
    s = e.scheduler
    s.add_request(make_request("a", range(1, 18), priority=5, arrival=0.0, ignore_eos=True))
    for k in range(30):
        if k == 1:
            s.add_request(make_request("b", [1, 2, 3], priority=0, arrival=1.0, ignore_eos=True))
        so = s.schedule()
        assert so.num_prefill_tokens >= 0 and so.num_decode_tokens >= 0
        assert so.num_prefill_tokens + so.num_decode_tokens == so.total_num_scheduled_tokens
        stats = s.get_stats()
        assert stats.last_step_num_decode_tokens >= 0
        s.update_from_output(so, e.executor.execute_model(so))
    assert s.num_preemptions > 0


# ---------------------------------------------------------------- 3. queued token count
def test_preempt_during_execution_keeps_the_queue_token_count():
    """vLLM's test_preempt_during_execution: two steps in flight; the second request is preempted
    while its step runs, and its late token lands while it waits."""
    e = make_engine(block_size=16, num_blocks=10, max_num_batched_tokens=100,
                    enable_prefix_caching=False, max_num_queued_tokens=100)
    s = e.scheduler
    r0 = make_request("0", [1] * 80, max_tokens=4, ignore_eos=True)
    r1 = make_request("1", [2] * 80, max_tokens=4, ignore_eos=True)
    s.add_request(r0)
    so0 = s.schedule()
    s.add_request(r1)
    so1 = s.schedule()  # the second request starts while the first step is in flight
    assert set(so1.num_scheduled_tokens) == {"1"}
    s.update_from_output(so0, ModelRunnerOutput(["0"], [[7]]))
    s.schedule()  # the first request needs a 6th block: the second one is preempted
    assert r1.status == RequestStatus.PREEMPTED and len(s.waiting) == 1
    s.update_from_output(so1, ModelRunnerOutput(["1"], [[42]]))
    assert r1.output_token_ids == [42]  # the late token is kept
    assert s.waiting.num_tokens == sum(r.num_tokens for r in s.waiting) == 81
    s.abort_requests(["0", "1"])
    assert len(s.waiting) == 0 and s.waiting.num_tokens == 0
    # The limit still holds exactly: 100 queued tokens fit, 101 do not.
    s.add_request(make_request("2", [3] * 100))
    from llmtower.core.errors import QueueFullError
    try:
        s.add_request(make_request("3", [4]))
        raise AssertionError("max_num_queued_tokens=100 admitted 101 tokens")
    except QueueFullError:
        pass


# ---------------------------------------------------------------- 4. livelock on equal arrival
def test_equal_arrival_times_do_not_livelock():
    e = make_engine(block_size=4, num_blocks=10, enable_prefix_caching=False,
                    long_prefill_token_threshold=8, max_num_partial_prefills=2)
    s = e.scheduler
    s.add_request(make_request("a", [1] * 36, arrival=0.0, ignore_eos=True, max_tokens=4))
    s.add_request(make_request("b", [2] * 36, arrival=0.0, ignore_eos=True, max_tokens=4))
    out = run_to_completion(e, max_steps=200)
    assert {k: len(v) for k, v in out.items()} == {"a": 4, "b": 4}
    assert s.num_preemptions <= 4
    assert_all_free(e)


def test_victim_order_breaks_arrival_ties_by_admission_order():
    e = make_engine()
    s = e.scheduler
    reqs = [make_request(f"c{i}", [1, 2, 3], arrival=5.0) for i in range(3)]
    for r in reqs:
        s.add_request(r)
    s.schedule()
    assert s.policy.victim(s.running) is reqs[2]
    keys = [s.policy.victim_key(r) for r in reqs]
    assert len(set(keys)) == 3


# ---------------------------------------------------------------- gaps with vLLM
def test_identical_prompts_in_one_step_share_blocks_and_produce_the_same_tokens():
    prompt = list(range(1, 30))  # 7 full blocks of 4 + 1 token

    def run(caching: bool):
        e = make_engine(block_size=4, num_blocks=64, max_num_batched_tokens=256,
                        enable_prefix_caching=caching)
        for i in range(3):
            e.scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=6, ignore_eos=True,
                                                 arrival=float(i)))
        so = e.scheduler.schedule()
        e.scheduler.update_from_output(so, e.executor.execute_model(so))
        out = run_to_completion(e)
        assert_all_free(e)
        return so.num_scheduled_tokens, out

    sched, out = run(True)
    assert sched == {"r0": 29, "r1": 1, "r2": 1}  # 28 tokens each hit r0's blocks of this step
    ref_sched, ref = run(False)
    assert ref_sched == {"r0": 29, "r1": 29, "r2": 29}
    assert out == ref


def test_blocks_of_a_request_preempted_in_its_step_leave_the_prefix_cache():
    """X registers the blocks its chunk fills when it is scheduled; Y, later in the same step,
    needs a block and preempts X (latest arrival), so X never computes them. They must not
    stay in the prefix cache: X itself and a copy of its prompt would read garbage (the fake
    executor reads the KV back, so the tokens would differ)."""
    prompt = list(range(1, 17))
    e = make_engine(block_size=4, num_blocks=6, long_prefill_token_threshold=8)
    s = e.scheduler
    s.add_request(make_request("X", prompt, max_tokens=4, arrival=1.0, ignore_eos=True))
    s.add_request(make_request("Y", [30] * 8, max_tokens=2, arrival=0.0, ignore_eos=True))
    assert step(e).num_scheduled_tokens == {"X": 8, "Y": 8}
    so = step(e)
    assert so.preempted_req_ids == {"X"} and so.num_scheduled_tokens == {"Y": 1}
    s.add_request(make_request("copy", prompt, max_tokens=4, arrival=2.0, ignore_eos=True))
    out = run_to_completion(e)
    ref = make_engine(block_size=4, num_blocks=64)
    ref.scheduler.add_request(make_request("X", prompt, max_tokens=4, ignore_eos=True))
    assert out["X"] == out["copy"] == run_to_completion(ref)["X"]
    assert_all_free(e)


def test_reset_prefix_cache_is_refused_while_blocks_are_in_use():
    e = make_engine(block_size=4)
    s = e.scheduler
    s.add_request(make_request("a", range(1, 10), max_tokens=20, ignore_eos=True))
    step(e)
    cached = len(s.kv.pool.cached)
    assert cached > 0
    assert s.reset_prefix_cache() is False
    assert len(s.kv.pool.cached) == cached  # nothing changed
    run_to_completion(e)
    assert s.reset_prefix_cache() is True
    assert not s.kv.pool.cached
    assert_all_free(e)


def test_outputs_for_unscheduled_requests_are_ignored():
    e = make_engine(max_num_seqs=1)
    s = e.scheduler
    s.add_request(make_request("a", [1, 2, 3], max_tokens=5, ignore_eos=True))
    s.add_request(make_request("b", [4, 5, 6], max_tokens=5, ignore_eos=True))
    so = s.schedule()
    assert set(so.num_scheduled_tokens) == {"a"}
    s.update_from_output(so, ModelRunnerOutput(["a", "b", "zzz"], [[9], [9], [9]]))
    assert s.requests["a"].output_token_ids == [9]
    assert s.requests["b"].output_token_ids == [] and s.waiting.num_tokens == 3
