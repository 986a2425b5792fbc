"""vLLM's scheduler scenarios (its tests/v1/core/test_scheduler.py and test_async_scheduler.py),
restated as behavioural tests of llmtower's scheduler.

Each test sets up the situation one of vLLM's scenarios checks and asserts what a user of
llmtower would notice: who runs, with how many tokens, what is emitted, what is preempted, and
that every block is back in the pool at the end. Sizes are scaled down (blocks of 4 slots, no
null block: llmtower's ``num_blocks`` are all usable). Where llmtower decides differently on
purpose (docs/scheduler.md), the test asserts the documented behaviour and says so.

Not ported: multimodal / encoder inputs, KV and EC connectors, structured-output internals,
LoRA, DP prefill throttling, spec-decode batch padding (a vLLM runner shape, not a behaviour),
and what tests/core already covers (min_tokens stops: test_scheduler_scenarios; preemption
while a step is in flight and reset_prefix_cache refusals: test_scheduler_regressions).
"""
from __future__ import annotations

from collections import deque

import pytest

from sched_helpers import EOS, assert_all_free, make_engine, make_request, run_to_completion
from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.core.request import RequestStatus
from llmtower.core.sched.async_scheduler import AsyncScheduler
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor, fake_next_token


def step(engine) -> SchedulerOutput:
    """Schedule one step, run it on the fake model and apply its output."""
    so = engine.scheduler.schedule()
    engine.scheduler.update_from_output(so, engine.executor.execute_model(so))
    return so


def output(so: SchedulerOutput, sampled: dict[str, list[int]],
           drafts: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
    """A hand-written model output for the requests ``so`` scheduled (absent ones: nothing
    sampled, as for a prefill chunk that did not reach the end of its prompt)."""
    rids = list(so.num_scheduled_tokens)
    spec = None if drafts is None else [drafts.get(r, []) for r in rids]
    return ModelRunnerOutput(rids, [sampled.get(r, []) for r in rids], spec_token_ids=spec)


def ids(reqs) -> list[str]:
    return [getattr(r, "req_id", None) or r.request_id for r in reqs]


# ================================================================ admission and accounting
def test_add_then_abort_one_by_one_tracks_waiting_and_unfinished_counts():
    e = make_engine()
    s = e.scheduler
    reqs = [make_request(i, [i + 1] * 5, arrival=float(i)) for i in range(10)]
    for i, r in enumerate(reqs):
        s.add_request(r)
        assert r.request_id in s.requests
        assert len(s.waiting) == s.get_num_unfinished_requests() == i + 1
    for i, r in enumerate(reqs):
        assert s.abort_requests([r.request_id]) == [r.request_id]
        assert r.status == RequestStatus.FINISHED_ABORTED and r.request_id not in s.requests
        assert len(s.waiting) == s.get_num_unfinished_requests() == 9 - i
    so = s.schedule()
    # Never sent to the executor, so it is not told to drop them either.
    assert so.num_scheduled_tokens == {} and so.finished_req_ids == set()
    assert_all_free(e)


@pytest.mark.parametrize("caching,prompt_logprobs", [(False, None), (True, 2)])
def test_ten_requests_are_admitted_whole_in_one_step_in_arrival_order(caching, prompt_logprobs):
    # The same prompt for everyone: with prefix caching they would hit each other's blocks in
    # this very step, but a request that asks for prompt logprobs needs every prompt token's
    # logits, so it computes its whole prompt anyway.
    e = make_engine(num_blocks=64, enable_prefix_caching=caching)
    s = e.scheduler
    for i in range(10):
        s.add_request(make_request(i, [3] * 10, arrival=float(i), prompt_logprobs=prompt_logprobs))
    so = s.schedule()
    assert ids(so.scheduled_new_reqs) == [str(i) for i in range(10)]
    assert so.scheduled_cached_reqs == [] and so.finished_req_ids == set()
    assert so.num_scheduled_tokens == {str(i): 10 for i in range(10)}
    assert len(s.waiting) == 0 and ids(s.running) == [str(i) for i in range(10)]
    s.update_from_output(so, e.executor.execute_model(so))
    run_to_completion(e)
    assert_all_free(e)


def test_same_prompt_without_prompt_logprobs_hits_the_blocks_computed_in_the_same_step():
    # The counterpart of the case above: no prompt logprobs, so the later requests reuse the
    # first one's full blocks and compute only the last, partial block.
    e = make_engine(num_blocks=64)
    for i in range(3):
        e.scheduler.add_request(make_request(i, [3] * 10, arrival=float(i)))
    so = e.scheduler.schedule()
    assert so.num_scheduled_tokens == {"0": 10, "1": 2, "2": 2}


@pytest.mark.parametrize("caching", [False, True])
def test_three_long_prompts_are_prefilled_side_by_side_under_the_threshold(caching):
    # vLLM v1 has no cap on partial prefills per step; llmtower's max_num_partial_prefills
    # (default 1) is raised to 3 to set up the same situation.
    e = make_engine(num_blocks=128, max_num_batched_tokens=100, long_prefill_token_threshold=40,
                    max_num_partial_prefills=3, enable_prefix_caching=caching)
    s = e.scheduler
    for i, name in enumerate("ABC"):
        s.add_request(make_request(name, [i + 1] * 80, arrival=float(i), ignore_eos=True))
    so = step(e)
    assert ids(so.scheduled_new_reqs) == ["A", "B", "C"] and so.scheduled_cached_reqs == []
    assert so.num_scheduled_tokens == {"A": 40, "B": 40, "C": 20}  # C gets what is left
    so = step(e)
    assert so.scheduled_new_reqs == [] and ids(so.scheduled_cached_reqs) == ["A", "B", "C"]
    assert so.num_scheduled_tokens == {"A": 40, "B": 40, "C": 20}
    assert len(s.running) == 3
    # A and B finished their prompts and sampled; now they decode beside C's next chunk.
    so = step(e)
    assert so.num_scheduled_tokens == {"A": 1, "B": 1, "C": 40}
    assert s.requests["A"].num_output_tokens == 2 and s.requests["C"].num_output_tokens == 1
    run_to_completion(e)
    assert_all_free(e)


def test_prefix_cache_statistics_count_a_request_once_when_it_is_admitted():
    e = make_engine(num_blocks=8, max_model_len=64)
    s = e.scheduler
    seed = list(range(1, 9))  # two full blocks
    s.add_request(make_request("seed", seed, max_tokens=2, ignore_eos=True))
    run_to_completion(e)
    queries, hits = s.kv.prefix_cache_queries, s.kv.prefix_cache_hits
    assert (queries, hits) == (8, 0)
    # A hog takes every block but the two cached ones of the seed (its prompt 5, its first
    # decode a 6th), so the next request (3 blocks, 2 of them cached) cannot be admitted yet,
    # and the lookups it made meanwhile are not counted.
    s.add_request(make_request("hog", range(30, 50), max_tokens=8, ignore_eos=True))
    step(e)
    s.add_request(make_request("late", seed + [20, 21, 22, 23], max_tokens=1, ignore_eos=True))
    so = step(e)
    assert "late" not in so.num_scheduled_tokens and s.kv.pool.num_free_blocks == 2
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (queries + 20, hits)
    s.abort_requests(["hog"])
    so = step(e)
    assert so.num_scheduled_tokens == {"late": 4}  # only the block that was not cached
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == (queries + 20 + 12, hits + 8)
    assert_all_free(e)


def test_prefix_cache_statistics_stay_zero_without_prefix_caching():
    e = make_engine(enable_prefix_caching=False)
    for i in range(2):
        e.scheduler.add_request(make_request(i, [5] * 9))
    e.scheduler.schedule()
    assert (e.scheduler.kv.prefix_cache_queries, e.scheduler.kv.prefix_cache_hits) == (0, 0)


def test_requests_added_step_by_step_leave_nothing_behind():
    e = make_engine(num_blocks=32)
    s = e.scheduler
    for i in range(5):
        s.add_request(make_request(i, [i + 1] * 10, max_tokens=10, ignore_eos=True))
        step(e)
    while s.has_unfinished_requests():
        step(e)
    so = s.schedule()  # tells the executor about the last finished requests
    assert so.finished_req_ids and s.finished_req_ids == set()
    assert_all_free(e)
    assert not e.scheduler._executor_has


def test_max_num_seqs_and_token_budget_hold_in_every_step():
    e = make_engine(num_blocks=128, max_num_seqs=2, max_num_batched_tokens=12)
    s = e.scheduler
    for i in range(5):
        s.add_request(make_request(i, [i + 1] * (6 + 3 * i), max_tokens=4, ignore_eos=True,
                                   arrival=float(i)))
    seen = 0
    while s.has_unfinished_requests():
        so = step(e)
        assert len(so.num_scheduled_tokens) <= 2 and len(s.running) <= 2
        assert 0 < so.total_num_scheduled_tokens <= 12
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
        seen = max(seen, so.total_num_scheduled_tokens)
    assert seen == 12  # the budget was reached, not just respected
    assert_all_free(e)


# ================================================================ ordering
@pytest.mark.parametrize("bypass,chunked,expected", [
    (8, True, ["1", "2"]),         # the second long prompt gets a chunk of what is left
    (0, False, ["1"]),             # strict order: nobody overtakes the second long prompt
    # llmtower's documented choice (docs/scheduler.md, "No head-of-line blocking"): a prompt
    # that does not fit is skipped, and short ones behind it run now. vLLM schedules only
    # "1" here; max_bypass=0 (above) gives vLLM's behaviour.
    (8, False, ["1", "3", "4"]),
])
def test_long_and_short_prompts_share_one_step(bypass, chunked, expected):
    e = make_engine(num_blocks=128, max_num_batched_tokens=128, max_model_len=128,
                    max_num_seqs=3, enable_chunked_prefill=chunked, max_bypass=bypass)
    s = e.scheduler
    for i, n in enumerate([100, 100, 10, 10]):
        s.add_request(make_request(str(i + 1), [i + 1] * n, arrival=float(i)))
    so = s.schedule()
    assert ids(so.scheduled_new_reqs) == expected
    assert so.total_num_scheduled_tokens <= 128


def test_a_second_step_is_scheduled_while_the_first_is_in_flight():
    """Two steps in flight on the plain scheduler: a request whose output is pending is not
    scheduled again, a new one is; once the output lands, it decodes."""
    e = make_engine(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=2)
    s = e.scheduler
    s.add_request(make_request("a", [1] * 32, ignore_eos=True))
    so0 = s.schedule()
    assert so0.num_scheduled_tokens == {"a": 32}
    s.add_request(make_request("b", [2] * 32, ignore_eos=True))
    so1 = s.schedule()
    assert so1.num_scheduled_tokens == {"b": 32} and ids(so1.scheduled_new_reqs) == ["b"]
    s.update_from_output(so0, output(so0, {"a": [7]}))
    so2 = s.schedule()
    assert so2.num_scheduled_tokens == {"a": 1}
    s.update_from_output(so1, output(so1, {"b": [8]}))
    s.update_from_output(so2, output(so2, {"a": [9]}))
    assert s.requests["a"].output_token_ids == [7, 9] and s.requests["b"].output_token_ids == [8]
    s.abort_requests(["a", "b"])
    assert_all_free(e)


# ================================================================ stop conditions with several tokens a step
def _drafting(prompts: dict[str, list[int]], drafts: dict[str, list[int]], first=5, **sp):
    """Requests prefilled in one step that sampled ``first`` and were given ``drafts``."""
    e = make_engine(num_blocks=64)
    s = e.scheduler
    for i, (rid, prompt) in enumerate(prompts.items()):
        s.add_request(make_request(rid, prompt, arrival=float(i), **sp))
    so = s.schedule()
    s.update_from_output(so, output(so, {rid: [first] for rid in prompts}, drafts))
    return e, s


def test_eos_among_verified_tokens_stops_there_and_the_other_request_goes_on():
    e, s = _drafting({"a": [1, 2, 3], "b": [4, 5, 6]}, {"a": [10, EOS], "b": [10]},
                     max_tokens=10)
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 3, "b": 2}
    assert so.scheduled_spec_decode_tokens == {"a": [10, EOS], "b": [10]}
    outs = s.update_from_output(so, output(so, {"a": [10, EOS, 12], "b": [10, 11]}))
    a = next(o for o in outs.outputs if o.request_id == "a")
    assert a.new_token_ids == [10, EOS] and a.finish_reason == "stop"
    assert ids(s.running) == ["b"] and s.requests["b"].output_token_ids == [5, 10, 11]
    assert "a" in s.schedule().finished_req_ids


def test_stop_token_among_verified_tokens_stops_there_with_its_reason():
    e, s = _drafting({"a": [1, 2, 3], "b": [4, 5, 6]}, {"a": [10, 42], "b": [13]},
                     max_tokens=10, stop_token_ids=[42, 43])
    so = s.schedule()
    outs = s.update_from_output(so, output(so, {"a": [10, 42, 12], "b": [13, 14]}))
    a = next(o for o in outs.outputs if o.request_id == "a")
    assert a.new_token_ids == [10, 42] and a.finish_reason == "stop" and a.stop_reason == 42
    assert ids(s.running) == ["b"] and s.requests["b"].output_token_ids == [5, 13, 14]


def test_drafts_never_reach_past_max_tokens():
    # llmtower trims the drafts to what the request may still output (core/sched/spec_drafts.py
    # next_drafts), so the verification step cannot overshoot max_tokens; vLLM schedules the
    # drafts and truncates the output afterwards. Either way the output stops at max_tokens.
    e, s = _drafting({"a": [1, 2, 3]}, {"a": [10, 11, 12]}, max_tokens=3)
    so = s.schedule()
    assert so.scheduled_spec_decode_tokens == {"a": [10]} and so.num_scheduled_tokens == {"a": 2}
    outs = s.update_from_output(so, output(so, {"a": [10, 11]}))
    assert outs.outputs[0].new_token_ids == [10, 11] and outs.outputs[0].finish_reason == "length"
    assert s.running == []
    s.schedule()
    assert_all_free(e)


def test_ignore_eos_goes_on_past_a_verified_eos():
    e, s = _drafting({"a": [1, 2, 3]}, {"a": [EOS, 10]}, max_tokens=10, ignore_eos=True)
    so = s.schedule()
    outs = s.update_from_output(so, output(so, {"a": [EOS, 10, 11]}))
    assert outs.outputs[0].new_token_ids == [EOS, 10, 11] and outs.outputs[0].finish_reason is None
    assert ids(s.running) == ["a"] and s.requests["a"].output_token_ids == [5, EOS, 10, 11]


# ================================================================ speculative decoding
@pytest.mark.parametrize("drafts,sampled,expected", [
    ([[1, 2, 3]], [[1, 2, 3, 4]], (1, 3, 3, [1, 1, 1])),          # all accepted
    ([[1, 2, 3]], [[1, 5]], (1, 3, 1, [1, 0, 0])),                # early mismatch
    ([[1, 2], [3]], [[1, 2, 5], [3, 4]], (2, 3, 3, [2, 1])),      # two requests
    ([[1]], [[1, 2]], (1, 1, 1, [1])),                            # a single draft
    ([[]], [[5]], (0, 0, 0, [])),                                 # no drafts: nothing counted
    ([[1, 2, 3], [4, 5, 6]], [[1, 2, 7], [4, 8]], (2, 6, 3, [2, 1, 0])),
])
def test_spec_decode_counts_drafts_and_accepted_tokens(drafts, sampled, expected):
    e = make_engine(num_blocks=64)
    s = e.scheduler
    rids = [str(i) for i in range(len(drafts))]
    for rid in rids:
        s.add_request(make_request(rid, [11 + int(rid)], max_tokens=8))
    so = s.schedule()
    assert so.num_scheduled_tokens == {rid: 1 for rid in rids}
    assert so.scheduled_spec_decode_tokens == {}
    s.update_from_output(so, output(so, {rid: [9] for rid in rids}, dict(zip(rids, drafts))))
    for rid, d in zip(rids, drafts):
        r = s.requests[rid]
        assert r.num_computed_tokens == 1 and r.num_tokens == 2 and r.spec_token_ids == d
    assert s.get_stats().spec_num_drafts == 0  # nothing verified yet
    so = s.schedule()
    assert so.num_scheduled_tokens == {rid: 1 + len(d) for rid, d in zip(rids, drafts)}
    assert so.total_num_scheduled_tokens == len(rids) + sum(map(len, drafts))
    assert so.scheduled_spec_decode_tokens == {rid: d for rid, d in zip(rids, drafts) if d}
    s.update_from_output(so, output(so, dict(zip(rids, sampled))))
    st = s.get_stats()
    assert (st.spec_num_drafts, st.spec_num_draft_tokens, st.spec_num_accepted_tokens,
            st.spec_num_accepted_tokens_per_pos) == expected
    for rid, toks in zip(rids, sampled):
        r = s.requests[rid]
        # Rejected drafts' progress is taken back: only the last sampled token is uncomputed.
        assert r.output_token_ids == [9] + toks and r.num_computed_tokens == r.num_tokens - 1
    s.abort_requests(rids)
    assert_all_free(e)


def test_drafts_are_not_scheduled_with_a_prefill_chunk():
    e = make_engine(num_blocks=64, max_num_batched_tokens=20)
    s = e.scheduler
    s.add_request(make_request("a", range(1, 33), max_tokens=8))
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 20}
    # A draft proposal for a request still in its prompt is ignored.
    s.update_from_output(so, output(so, {}, {"a": [1, 2, 3]}))
    assert s.requests["a"].spec_token_ids == []
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 12} and so.scheduled_spec_decode_tokens == {}
    s.update_from_output(so, output(so, {"a": [42]}, {"a": [1, 2, 3]}))
    assert s.requests["a"].spec_token_ids == [1, 2, 3]
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}


# ================================================================ priority
def _priority_engine(**kw):
    kw.setdefault("num_blocks", 256)
    return make_engine(policy="priority", enable_prefix_caching=False, **kw)


@pytest.mark.parametrize("priorities,arrivals,expected", [
    ([2, 0, 1], [1.0, 2.0, 3.0], ["1", "2", "0"]),             # lower value first
    ([1, 1, 1], [3.0, 1.0, 2.0], ["1", "2", "0"]),             # ties: earlier arrival first
    ([2, 1, 1, 0], [1.0, 3.0, 2.0, 4.0], ["3", "2", "1", "0"]),
    ([1, 1, 1, 1], [4.0, 1.0, 3.0, 2.0], ["1", "3", "2", "0"]),  # one priority: FCFS
])
def test_priority_orders_the_batch_of_one_step(priorities, arrivals, expected):
    e = _priority_engine()
    s = e.scheduler
    for i, (p, t) in enumerate(zip(priorities, arrivals)):
        s.add_request(make_request(str(i), [i + 1] * 5, priority=p, arrival=t))
    so = s.schedule()
    assert ids(so.scheduled_new_reqs) == expected and list(so.num_scheduled_tokens) == expected


@pytest.mark.parametrize("max_seqs,priorities,arrivals,running,waiting", [
    (1, [3, 2, 0], [1.0, 2.0, 3.0], ["2"], ["1", "0"]),
    (1, [2, 2, 2], [3.0, 1.0, 2.0], ["1"], ["2", "0"]),
    (1, [3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], ["3"], ["1", "2", "0"]),
    (2, [3, 1, 2, 0], [1.0, 2.0, 3.0, 4.0], ["3", "1"], ["2", "0"]),
])
def test_priority_with_limited_slots_keeps_the_rest_waiting_in_order(max_seqs, priorities,
                                                                      arrivals, running, waiting):
    e = _priority_engine(max_num_seqs=max_seqs)
    s = e.scheduler
    for i, (p, t) in enumerate(zip(priorities, arrivals)):
        s.add_request(make_request(str(i), [i + 1] * 10, priority=p, arrival=t))
    so = s.schedule()
    assert ids(so.scheduled_new_reqs) == running and not so.preempted_req_ids
    assert ids(s.waiting) == waiting
    assert [s.requests[r].priority for r in ids(s.waiting)] == sorted(
        priorities[int(r)] for r in waiting)


def test_running_high_priority_request_keeps_its_blocks_and_the_low_one_is_preempted():
    # 5 blocks of 4 slots. lo (8 tokens) runs first; hi (8 tokens) arrives and both run; when
    # hi needs a third block none is free, and lo goes although it was running first.
    e = _priority_engine(num_blocks=5, max_num_seqs=3, max_num_batched_tokens=64,
                         max_model_len=20)
    s = e.scheduler
    s.add_request(make_request("lo", [1] * 8, priority=5, arrival=1.0, max_tokens=6,
                               ignore_eos=True))
    step(e)  # lo: 9 tokens
    s.add_request(make_request("hi", [2] * 8, priority=0, arrival=2.0, max_tokens=6,
                               ignore_eos=True))
    so = step(e)  # lo takes its third block, hi its two: the cache is full
    assert ids(so.scheduled_new_reqs) == ["hi"] and len(s.running) == 2
    assert s.kv.pool.num_free_blocks == 0
    so = s.schedule()
    assert so.preempted_req_ids == {"lo"} and so.num_scheduled_tokens == {"hi": 1}
    assert s.requests["lo"].status == RequestStatus.PREEMPTED and ids(s.running) == ["hi"]
    s.update_from_output(so, e.executor.execute_model(so))
    run_to_completion(e)
    assert_all_free(e)


def test_high_priority_arrival_does_not_preempt_when_there_is_room():
    e = _priority_engine(max_num_seqs=3, max_num_batched_tokens=200)
    s = e.scheduler
    for i, name in enumerate(["lo1", "lo2"]):
        s.add_request(make_request(name, [i + 1] * 30, priority=5, arrival=float(i)))
    step(e)
    s.add_request(make_request("hi", [9] * 30, priority=0, arrival=3.0))
    so = s.schedule()
    assert ids(so.scheduled_new_reqs) == ["hi"] and not so.preempted_req_ids
    assert len(s.running) == 3 and len(s.waiting) == 0


def test_priority_preemption_then_resumption_recomputes_the_low_request_with_its_outputs():
    # 4 blocks of 4 slots: lo (6 tokens) and hi (8 tokens) fill them; hi's ninth token needs
    # a block, so lo is preempted; when hi is gone, lo resumes with all of its tokens.
    e = _priority_engine(num_blocks=4, max_num_seqs=2, max_num_batched_tokens=64,
                         max_model_len=16)
    s = e.scheduler
    lo_prompt = [3, 1, 4, 1, 5, 9]
    s.add_request(make_request("lo", lo_prompt, priority=1, arrival=0.0, max_tokens=6,
                               ignore_eos=True))
    so = step(e)
    assert ids(so.scheduled_new_reqs) == ["lo"] and len(s.running) == 1
    s.add_request(make_request("hi", [2, 7, 1, 8, 2, 8, 1, 8], priority=0, arrival=1.0,
                               max_tokens=6, ignore_eos=True))
    so = step(e)
    assert ids(so.scheduled_new_reqs) == ["hi"] and ids(so.scheduled_cached_reqs) == ["lo"]
    assert s.kv.pool.num_free_blocks == 0 and len(s.waiting) == 0 and len(s.running) == 2
    so = step(e)
    assert so.scheduled_new_reqs == [] and ids(so.scheduled_cached_reqs) == ["hi"]
    assert s.requests["lo"].status == RequestStatus.PREEMPTED
    assert len(s.waiting) == 1 and len(s.running) == 1
    lo_outputs = list(s.requests["lo"].output_token_ids)
    assert len(lo_outputs) == 2
    s.abort_requests(["hi"])
    so = s.schedule()
    assert so.scheduled_new_reqs == [] and len(s.waiting) == 0 and len(s.running) == 1
    (resumed,) = so.scheduled_cached_reqs
    assert resumed.req_id == "lo" and resumed.resumed_from_preemption
    assert resumed.new_token_ids == lo_outputs  # the executor gets back every token
    assert so.num_scheduled_tokens == {"lo": 8}  # 6 prompt + 2 outputs, recomputed
    (resumed_out,) = s.update_from_output(so, e.executor.execute_model(so)).outputs
    out = run_to_completion(e)
    assert_all_free(e)
    # The same tokens as lo running alone: the resume lost nothing.
    alone = make_engine(num_blocks=64, enable_prefix_caching=False)
    alone.scheduler.add_request(make_request("lo", lo_prompt, max_tokens=6, ignore_eos=True))
    assert lo_outputs + resumed_out.new_token_ids + out["lo"] == run_to_completion(alone)["lo"]


# ================================================================ async scheduling
def _async_engine(**kw) -> EngineCore:
    cache = CacheConfig(block_size=4, num_blocks=kw.pop("num_blocks", 256),
                        enable_prefix_caching=kw.pop("enable_prefix_caching", True))
    cls = AsyncScheduler if kw.pop("async_scheduling", True) else Scheduler
    return EngineCore(cls(SchedulerConfig(**kw), cache), FakeExecutor(cache.num_blocks, 4, 0, 64))


def _drain_two_in_flight(e: EngineCore, first: list[SchedulerOutput], before_each=None,
                         after_schedule=None) -> int:
    """Keep up to two steps in flight: apply the oldest, schedule the next. Returns the
    tokens scheduled over the whole run."""
    s = e.scheduler
    in_flight = deque(first)
    total = 0
    while in_flight:
        if before_each is not None:
            before_each()
        so = in_flight.popleft()
        total += so.total_num_scheduled_tokens
        s.update_from_output(so, e.executor.execute_model(so))
        so = s.schedule()
        if after_schedule is not None:
            after_schedule(so)
        if so.num_scheduled_tokens:
            in_flight.append(so)
    return total


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5])
def test_async_length_stop_schedules_no_token_past_max_tokens(max_tokens):
    e = _async_engine()
    s = e.scheduler
    reqs = [make_request(i, [i + 1] * (5 + i), max_tokens=max_tokens, ignore_eos=True)
            for i in range(2)]
    s.add_request(reqs[0])
    first = [s.schedule()]
    s.add_request(reqs[1])
    first.append(s.schedule())
    total = _drain_two_in_flight(e, first)
    assert s.get_num_unfinished_requests() == 0
    assert [r.num_output_tokens for r in reqs] == [max_tokens, max_tokens]
    # Every prompt token once, then one decode per further output token: nothing wasted.
    assert total == sum(r.num_prompt_tokens + max_tokens - 1 for r in reqs)
    assert_all_free(e)


def test_async_abort_with_two_steps_in_flight_stops_each_request_where_it_was():
    e = _async_engine()
    s = e.scheduler
    reqs = [make_request(i, [i + 1] * 6, max_tokens=20, ignore_eos=True) for i in range(10)]
    for r in reqs:
        s.add_request(r)
    first = [s.schedule(), s.schedule()]
    order = [0, 8, 3, 1, 6, 4, 2, 5, 7, 9]
    pending = list(order)

    def abort_next():
        if pending:
            s.abort_requests([reqs[pending.pop(0)].request_id])

    _drain_two_in_flight(e, first, before_each=abort_next)
    for i, r in enumerate(reqs):
        assert r.status == RequestStatus.FINISHED_ABORTED
        assert r.num_output_tokens == order.index(i)  # one token per step applied before
    assert_all_free(e)


def test_async_same_prompt_requests_compute_only_their_last_partial_block():
    e = _async_engine(max_num_batched_tokens=1000)
    s = e.scheduler
    prompt = [7] * 25  # 6 full blocks + 1 token
    reqs = [make_request(i, prompt, max_tokens=3, ignore_eos=True) for i in range(5)]
    s.add_request(reqs[0])
    s.add_request(reqs[1])
    so = s.schedule()
    assert so.num_scheduled_tokens == {"0": 25, "1": 1}
    later = deque(reqs[2:])
    added: list[str] = []

    def add_next():
        if later:
            r = later.popleft()
            s.add_request(r)
            added.append(r.request_id)

    def check(so):
        if added:
            assert so.num_scheduled_tokens[added.pop()] == 1

    _drain_two_in_flight(e, [so, s.schedule()], before_each=add_next, after_schedule=check)
    assert s.get_num_unfinished_requests() == 0
    assert_all_free(e)


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_next_turn_prompts_hit_the_blocks_the_previous_turn_decoded(async_scheduling):
    # Under --async-scheduling this failed (51 tokens scheduled, not 3): blocks were hashed
    # while their last token was still being sampled (see the next test).
    e = _async_engine(max_num_batched_tokens=1000, async_scheduling=async_scheduling)
    s = e.scheduler
    reqs = [make_request(i, [i + 1] * 25, max_tokens=50, ignore_eos=True) for i in range(5)]
    for r in reqs:
        s.add_request(r)
    if async_scheduling:
        _drain_two_in_flight(e, [s.schedule(), s.schedule()])
    else:
        run_to_completion(e)
    assert s.get_num_unfinished_requests() == 0
    # The next turn's prompt is the whole previous conversation (75 tokens): every full
    # block of it was computed in the previous turn, so only the last 3 tokens are new.
    for r in reqs:
        s.add_request(make_request(f"next{r.request_id}", r.all_token_ids, max_tokens=2,
                                   ignore_eos=True))
    so = s.schedule()
    assert so.num_scheduled_tokens == {f"next{r.request_id}": 75 % 4 for r in reqs}


def test_async_block_holding_an_unsampled_token_is_never_shared():
    """The bug behind the async multi-turn case, seen in tokens. Under --async-scheduling a
    block was registered in the prefix cache while the token of its last slot was still being
    sampled, under a hash of its first slots alone. Two requests equal up to that slot then
    registered the same hash, and the one that was preempted and resumed picked up the
    other's block, reading the other's token there. Both must get the tokens they get alone."""

    def token_fn(rid, seq):  # A and B agree for two tokens, then differ
        if len(seq) < 27:
            return 1
        if len(seq) == 27:
            return 1 if rid == "A" else 2
        return fake_next_token(seq, 64)

    e = EngineCore(AsyncScheduler(SchedulerConfig(policy="priority", max_num_seqs=2),
                                  CacheConfig(block_size=4, num_blocks=64)),
                   FakeExecutor(64, 4, 0, 64, token_fn=token_fn))
    s = e.scheduler
    for rid, prio in (("A", 0), ("B", 1)):
        s.add_request(make_request(rid, [7] * 25, priority=prio, max_tokens=12, ignore_eos=True,
                                   arrival=0.0))
    reqs = dict(s.requests)
    steps = [0]

    def arrive():
        steps[0] += 1
        if steps[0] == 5:  # C displaces B (max_num_seqs), runs one step and is gone
            s.add_request(make_request("C", [9, 9, 9], priority=0, max_tokens=1,
                                       ignore_eos=True, arrival=1.0))

    _drain_two_in_flight(e, [s.schedule(), s.schedule()], before_each=arrive)
    assert reqs["B"].num_preemptions == 1
    assert_all_free(e)
    for rid in "AB":
        ref = make_engine(num_blocks=64, enable_prefix_caching=False)
        ref.executor.token_fn = token_fn
        ref.scheduler.add_request(make_request(rid, [7] * 25, max_tokens=12, ignore_eos=True))
        assert reqs[rid].output_token_ids == run_to_completion(ref)[rid], rid
    assert reqs["A"].output_token_ids[2] != reqs["B"].output_token_ids[2]
