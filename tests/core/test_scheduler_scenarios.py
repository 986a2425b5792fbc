"""Scenario tests of the scheduler, driven step by step with the fake model."""
from __future__ import annotations

import pytest

from sched_helpers import EOS, assert_all_free, make_engine, make_request, run_to_completion
from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.outputs import ModelRunnerOutput
from llmtower.core.request import RequestStatus


def step_plan(engine):
    """Schedule and execute one step; return {req_id: tokens scheduled}."""
    so = engine.scheduler.schedule()
    mro = engine.executor.execute_model(so)
    engine.scheduler.update_from_output(so, mro)
    return dict(so.num_scheduled_tokens)


def test_small_batch_admitted_in_one_step_in_arrival_order():
    e = make_engine(num_blocks=64, max_num_batched_tokens=256)
    for i in range(5):
        # Distinct prompts: identical prefixes would hit each other's blocks in this step.
        e.scheduler.add_request(make_request(i, range(10 * i + 1, 10 * i + 6 + i), arrival=float(i)))
    so = e.scheduler.schedule()
    assert list(so.num_scheduled_tokens) == ["0", "1", "2", "3", "4"]
    assert [r.req_id for r in so.scheduled_new_reqs] == ["0", "1", "2", "3", "4"]
    assert so.num_scheduled_tokens == {str(i): 5 + i for i in range(5)}
    assert so.total_num_scheduled_tokens == sum(range(5, 10))
    assert [r.request_id for r in e.scheduler.running] == ["0", "1", "2", "3", "4"]


def test_three_long_prompts_share_budget_with_partial_prefill_threshold():
    e = make_engine(num_blocks=128, max_num_batched_tokens=32, long_prefill_token_threshold=16,
                    max_num_partial_prefills=2)
    for i, name in enumerate("ABC"):
        e.scheduler.add_request(make_request(name, [i + 1] * 40, max_tokens=3, arrival=float(i),
                                             ignore_eos=True))
    plans = [step_plan(e) for _ in range(6)]
    assert plans == [
        {"A": 16, "B": 16},            # two partial prefills fill the budget; C waits
        {"A": 16, "B": 16},
        {"A": 8, "B": 8, "C": 16},     # A and B finish their prompts; C starts (one partial)
        {"A": 1, "B": 1, "C": 16},     # decodes are mixed with C's chunk
        {"A": 1, "B": 1, "C": 8},      # A and B reach max_tokens=3 here
        {"C": 1},
    ]
    step_plan(e)
    assert_all_free(e)


def test_partial_prefill_limit_defers_a_second_long_prompt():
    e = make_engine(num_blocks=128, max_num_batched_tokens=32, max_num_partial_prefills=1)
    e.scheduler.add_request(make_request("A", [1] * 40, arrival=0.0, ignore_eos=True))
    e.scheduler.add_request(make_request("B", [2] * 40, arrival=1.0, ignore_eos=True))
    e.scheduler.add_request(make_request("C", range(1, 5), arrival=2.0))
    # A takes a partial chunk; B would be a second partial prefill and is skipped; C fits whole
    # but the budget is gone.
    assert step_plan(e) == {"A": 32}
    assert step_plan(e) == {"A": 8, "B": 24}
    assert step_plan(e) == {"A": 1, "B": 16, "C": 4}


def _hol_engine(max_bypass):
    e = make_engine(num_blocks=256, max_num_batched_tokens=64, max_model_len=64,
                    enable_chunked_prefill=False, max_bypass=max_bypass)
    s = e.scheduler
    s.add_request(make_request("D1", range(1, 41), max_tokens=6, arrival=0.0, ignore_eos=True))
    s.add_request(make_request("D2", range(2, 22), max_tokens=6, arrival=0.5, ignore_eos=True))
    step_plan(e)  # D1, D2 prefilled; from now on they decode one token a step each
    s.add_request(make_request("L", [7] * 63, max_tokens=2, arrival=1.0, ignore_eos=True))
    for i in range(1, 4):
        s.add_request(make_request(f"S{i}", range(1, 5), max_tokens=3, arrival=1.0 + i,
                                   ignore_eos=True))
    first_step: dict[str, int] = {}
    for step in range(1, 40):
        if not s.has_unfinished_requests():
            break
        for rid in step_plan(e):
            first_step.setdefault(rid, step)
    assert_all_free(e)
    return sorted(first_step, key=lambda r: first_step[r]), first_step


def test_no_chunking_long_prompt_blocks_short_ones_when_bypass_is_zero():
    # Strict order: L (63 tokens) does not fit beside D's decode, and nobody may overtake it.
    order, first = _hol_engine(max_bypass=0)
    assert order == ["D1", "D2", "L", "S1", "S2", "S3"]


def test_no_head_of_line_blocking_with_a_bounded_bypass():
    # L does not fit; S1 and S2 may overtake it (max_bypass=2), then room is reserved for L:
    # S3 is admitted only after L.
    order, first = _hol_engine(max_bypass=2)
    assert first["S1"] < first["L"] and first["S2"] < first["L"]
    assert first["L"] < first["S3"]


# ---------------------------------------------------------------- stop conditions
def scripted_engine(script: dict[str, list[int]], **kw):
    e = make_engine(num_blocks=64, **kw)
    pos: dict[str, int] = {}

    def token_fn(rid, _seq):
        i = pos.get(rid, 0)
        pos[rid] = i + 1
        return script[rid][i]

    e.executor.token_fn = token_fn
    return e


@pytest.mark.parametrize("kw,script,expected,reason", [
    (dict(), [5, 6, EOS, 7], [5, 6, EOS], "stop"),
    (dict(ignore_eos=True), [5, EOS, 6, 7, 8, 9, 9, 9, 9], [5, EOS, 6, 7, 8, 9, 9, 9], "length"),
    (dict(stop_token_ids=[7]), [5, 6, 7, 8], [5, 6, 7], "stop"),
    (dict(min_tokens=3), [EOS, 7, EOS, 4, 4], [EOS, 7, EOS], "stop"),
    (dict(min_tokens=2, stop_token_ids=[7]), [7, 7, 7], [7, 7], "stop"),
    (dict(max_tokens=2), [5, 6, 7], [5, 6], "length"),
])
def test_stop_conditions_give_exact_outputs(kw, script, expected, reason):
    params = dict(max_tokens=8)
    params.update(kw)
    e = scripted_engine({"r": script})
    e.scheduler.add_request(make_request("r", [1, 2, 3], **params))
    out = run_to_completion(e)
    assert out["r"] == expected
    assert run_to_completion.finish["r"] == reason
    assert_all_free(e)


def test_stop_token_reason_is_reported():
    e = scripted_engine({"r": [5, 9, 1]})
    e.scheduler.add_request(make_request("r", [1, 2], stop_token_ids=[9]))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step().outputs
    assert outs[-1].finish_reason == "stop" and outs[-1].stop_reason == 9
    assert outs[-1].metrics is not None and outs[-1].metrics.num_generation_tokens == 2


# ---------------------------------------------------------------- preemption
def test_preemption_picks_latest_arrival_and_stray_output_is_ignored():
    # 6 blocks of 4 slots: A, B, C hold 2 blocks each; the next decode step needs a 3rd block.
    e = make_engine(num_blocks=6, max_model_len=64, enable_prefix_caching=False)
    s = e.scheduler
    for i, name in enumerate("ABC"):
        s.add_request(make_request(name, [10 + i] * 7, max_tokens=10, arrival=float(i),
                                   ignore_eos=True))
    step_plan(e)   # prefill: 7 tokens each, 2 blocks each
    step_plan(e)   # decode into slot 8: still 2 blocks each
    so = s.schedule()  # slot 9 needs a new block for everyone: C (latest arrival) is preempted
    assert so.preempted_req_ids == {"C"}
    assert s.requests["C"].status == RequestStatus.PREEMPTED
    assert s.requests["C"].num_computed_tokens == 0
    assert set(so.num_scheduled_tokens) == {"A", "B"}
    # An output for C from a step that did not schedule C is ignored (as vLLM does).
    before = s.requests["C"].num_tokens
    s.update_from_output(so, e.executor.execute_model(so))
    s.update_from_output(so, ModelRunnerOutput(["C"], [[42]]))
    assert s.requests["C"].num_tokens == before
    assert s.num_preemptions == 1 and s.requests["C"].num_preemptions == 1
    assert s.requests["C"].times.preempted


def _three_requests_at_the_block_limit(**kw):
    """6 blocks of 4 slots; A, B, C hold 2 blocks each and the next step needs a third."""
    e = make_engine(num_blocks=6, preemption_mode="swap", max_model_len=64,
                    enable_prefix_caching=False, **kw)
    for i, name in enumerate("ABC"):
        e.scheduler.add_request(make_request(name, [10 + i] * 7, max_tokens=3, arrival=float(i),
                                             ignore_eos=True))
    step_plan(e)
    step_plan(e)
    return e, e.scheduler


def test_swap_preemption_moves_victim_to_swapped_and_back():
    e, s = _three_requests_at_the_block_limit(num_cpu_blocks=8)
    so = s.schedule()
    assert so.preempted_req_ids == {"C"} and len(so.blocks_to_swap_out) == 2
    assert [r.request_id for r in s.swapped] == ["C"]
    s.update_from_output(so, e.executor.execute_model(so))
    run_to_completion(e)
    assert s.num_swap_ins == 1
    assert_all_free(e)


def test_swap_falls_back_to_recompute_without_cpu_blocks():
    e, s = _three_requests_at_the_block_limit(num_cpu_blocks=1)
    s.schedule()
    assert not s.swapped and s.requests["C"].status == RequestStatus.PREEMPTED


# ---------------------------------------------------------------- priority
def test_priority_order():
    e = make_engine(num_blocks=64, policy="priority", max_num_seqs=1)
    s = e.scheduler
    for name, prio, arrival in [("0", 2, 1.0), ("1", 1, 3.0), ("2", 1, 2.0), ("3", 0, 4.0)]:
        s.add_request(make_request(name, [1, 2, 3], max_tokens=2, priority=prio, arrival=arrival,
                                   ignore_eos=True))
    order = []
    while s.has_unfinished_requests():
        for rid in step_plan(e):
            if rid not in order:
                order.append(rid)
    assert order == ["3", "2", "1", "0"]


def test_priority_preempts_lower_priority_at_max_num_seqs():
    e = make_engine(num_blocks=64, policy="priority", max_num_seqs=2)
    s = e.scheduler
    s.add_request(make_request("low1", [1, 2, 3], max_tokens=20, priority=5, arrival=0.0, ignore_eos=True))
    s.add_request(make_request("low2", [1, 2, 3], max_tokens=20, priority=5, arrival=1.0, ignore_eos=True))
    step_plan(e)
    s.add_request(make_request("high", [4, 5, 6], max_tokens=2, priority=0, arrival=2.0, ignore_eos=True))
    so = s.schedule()
    assert "high" in so.num_scheduled_tokens
    assert so.preempted_req_ids == {"low2"}  # the latest-arrived of the lowest priority
    s.update_from_output(so, e.executor.execute_model(so))
    run_to_completion(e)
    assert_all_free(e)


def test_priority_preempts_lower_priority_at_kv_limit():
    e = make_engine(num_blocks=4, policy="priority", max_num_seqs=8, max_model_len=64,
                    enable_prefix_caching=False)
    s = e.scheduler
    s.add_request(make_request("low", [1] * 12, max_tokens=4, priority=3, arrival=0.0, ignore_eos=True))
    step_plan(e)  # holds 3 of 4 blocks
    s.add_request(make_request("high", [2] * 8, max_tokens=2, priority=1, arrival=1.0, ignore_eos=True))
    so = s.schedule()
    assert so.preempted_req_ids == {"low"} and "high" in so.num_scheduled_tokens
    s.update_from_output(so, e.executor.execute_model(so))
    # An equal-priority request never preempts.
    s.add_request(make_request("peer", [3] * 8, max_tokens=2, priority=1, arrival=2.0, ignore_eos=True))
    so = s.schedule()
    assert not so.preempted_req_ids
    s.update_from_output(so, e.executor.execute_model(so))
    run_to_completion(e)
    assert_all_free(e)


def test_priority_on_fcfs_scheduler_is_an_error():
    e = make_engine(policy="fcfs")
    with pytest.raises(AdmissionError, match="priority"):
        e.scheduler.add_request(make_request("x", [1, 2], priority=1))
    assert not e.scheduler.has_unfinished_requests()


def test_sjf_runs_short_first_and_ages_long_requests():
    e = make_engine(num_blocks=256, policy="sjf", max_num_seqs=1)
    s = e.scheduler
    s.add_request(make_request("long", [1] * 50, max_tokens=50, arrival=0.0, ignore_eos=True))
    s.add_request(make_request("short", [1] * 5, max_tokens=5, arrival=0.1, ignore_eos=True))
    first = step_plan(e)
    assert list(first) == ["short"]
    # Aging: a short request arriving long after the long one no longer overtakes it.
    e2 = make_engine(num_blocks=256, policy="sjf", max_num_seqs=1, sjf_aging_tokens_per_s=100.0)
    e2.scheduler.add_request(make_request("long", [1] * 50, max_tokens=50, arrival=0.0, ignore_eos=True))
    e2.scheduler.add_request(make_request("short", [1] * 5, max_tokens=5, arrival=2.0, ignore_eos=True))
    assert list(step_plan(e2)) == ["long"]


# ---------------------------------------------------------------- abort and admission
def test_abort_in_every_state_and_twice_is_harmless():
    e = make_engine(num_blocks=6, num_cpu_blocks=8, preemption_mode="swap",
                    max_num_batched_tokens=8, max_model_len=64, enable_prefix_caching=False)
    s = e.scheduler
    for i, name in enumerate("ABC"):
        s.add_request(make_request(name, [10 + i] * 7, max_tokens=20, arrival=float(i), ignore_eos=True))
    s.add_request(make_request("W", [1] * 7, max_tokens=2, arrival=9.0))
    for _ in range(6):
        step_plan(e)
    states = {r.request_id: r.status for r in s.requests.values()}
    assert RequestStatus.SWAPPED in states.values() or RequestStatus.PREEMPTED in states.values()
    assert s.abort_requests(list(states)) == list(states)
    assert s.abort_requests(list(states)) == []
    so = s.schedule()
    assert so.finished_req_ids  # the executor is told to drop them
    assert_all_free(e)


def test_abort_mid_prefill_frees_blocks_that_step():
    e = make_engine(num_blocks=64, max_num_batched_tokens=8)
    s = e.scheduler
    s.add_request(make_request("A", range(1, 30)))
    step_plan(e)
    assert s.kv.num_blocks_of("A") > 0
    s.abort_requests(["A"])
    assert_all_free(e)


def test_admission_rejects_requests_that_can_never_run():
    e = make_engine(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(AdmissionError, match="max_model_len"):
        e.scheduler.add_request(make_request("a", [1] * 32))
    with pytest.raises(AdmissionError, match="KV cache"):
        e.scheduler.add_request(make_request("b", [1] * 20))
    with pytest.raises(AdmissionError, match="min_tokens"):
        e.scheduler.add_request(make_request("c", [1] * 10, min_tokens=30, max_tokens=30))
    assert not e.scheduler.has_unfinished_requests()


def test_queue_limits_raise_queue_full():
    e = make_engine(max_num_queued_reqs=2)
    e.scheduler.add_request(make_request("a", [1]))
    e.scheduler.add_request(make_request("b", [1]))
    with pytest.raises(QueueFullError, match="max_num_queued_reqs"):
        e.scheduler.add_request(make_request("c", [1]))
    e2 = make_engine(max_num_queued_tokens=10)
    e2.scheduler.add_request(make_request("a", [1] * 8))
    with pytest.raises(QueueFullError, match="max_num_queued_tokens"):
        e2.scheduler.add_request(make_request("b", [1] * 3))
    with pytest.raises(AdmissionError, match="max_num_queued_tokens"):  # could never be queued
        e2.scheduler.add_request(make_request("c", [1] * 11))


def test_max_tokens_is_capped_by_cache_capacity():
    # A request that would outgrow the whole KV cache stops there instead of preempting itself forever.
    e = make_engine(num_blocks=4, block_size=4, max_model_len=1000)
    e.scheduler.add_request(make_request("a", [1] * 6, max_tokens=100, ignore_eos=True))
    out = run_to_completion(e)
    assert len(out["a"]) == 16 - 6 and run_to_completion.finish["a"] == "length"
    assert_all_free(e)


def test_everything_is_free_after_all_requests_finish():
    e = make_engine(num_blocks=24, num_cpu_blocks=10, preemption_mode="swap", max_model_len=128,
                    max_num_batched_tokens=16)
    for i in range(12):
        e.scheduler.add_request(make_request(i, [i % 3 + 1] * (5 + 3 * i), max_tokens=9))
    run_to_completion(e)
    assert_all_free(e)
    assert not e.scheduler._executor_has
