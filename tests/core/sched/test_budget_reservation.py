"""Budget reservation (issue 17): a waiting request that the policy serves first (``fair``: a
less-served tenant; ``priority``: a more important request) starts at the very next step even
when a running request's long prompt would take the whole token budget in chunks. The running
prefill's chunk shrinks (nothing is preempted, no work is lost), decodes never yield, and the
step never exceeds its budget. (The reservation is for a waiting request's prompt; the
decodes of requests admitted after a long prompt still wait for its chunks unless
``long_prefill_token_threshold`` caps them, as in vLLM.) Deterministic, at the scheduler level, with the fake model."""
from __future__ import annotations

from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from tests.core.sched_helpers import assert_all_free, make_engine, run_to_completion

BUDGET = 32


def _req(rid: str, prompt_len: int, tenant: str = "", priority: int = 0, max_tokens: int = 4,
         arrival: float = 0.0) -> Request:
    return Request(rid, [(7 * i + len(rid)) % 50 + 1 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0,
                   priority=priority, arrival_time=arrival, tenant=tenant)


def _step(engine, outputs: dict[str, list[int]] | None = None):
    so = engine.scheduler.schedule()
    out = engine.scheduler.update_from_output(so, engine.executor.execute_model(so))
    for o in out.outputs if outputs is not None else ():
        outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    return so


def _engine(policy: str, max_num_seqs: int = 4, **kw):
    return make_engine(policy=policy, num_blocks=256, block_size=4, max_num_seqs=max_num_seqs,
                       max_num_batched_tokens=BUDGET, max_model_len=512,
                       enable_prefix_caching=False, **kw)


def _alone(req: Request) -> list[int]:
    e = _engine("fcfs")
    e.scheduler.add_request(_req(req.request_id, req.num_prompt_tokens, max_tokens=req.max_tokens))
    return run_to_completion(e)[req.request_id]


def test_fair_light_tenant_starts_next_step_behind_a_heavy_long_prompt():
    e = _engine("fair")
    s = e.scheduler
    out: dict[str, list[int]] = {}
    s.add_request(_req("heavy", 200, tenant="heavy"))
    assert _step(e, out).num_scheduled_tokens == {"heavy": BUDGET}  # a chunk of the long prompt
    s.add_request(_req("light", 8, tenant="light", arrival=1.0))
    so = _step(e, out)
    # The light tenant's whole prompt runs this step; the heavy chunk gives up room for it
    # (before: the heavy chunk took all 32 tokens for 6 more steps and the light request waited).
    assert so.num_scheduled_tokens == {"heavy": BUDGET - 8, "light": 8}
    assert so.total_num_scheduled_tokens == BUDGET
    assert so.preempted_req_ids == set()
    assert len(out["light"]) == 1  # its first token, at once
    for rid, toks in run_to_completion(e).items():
        out.setdefault(rid, []).extend(toks)
    assert_all_free(e)
    # The same tokens as each request alone: a smaller chunk changes nothing but timing.
    assert out["light"] == _alone(_req("light", 8))
    assert out["heavy"] == _alone(_req("heavy", 200))


def test_priority_request_starts_next_step_behind_a_low_priority_long_prompt():
    e = _engine("priority")
    s = e.scheduler
    s.add_request(_req("low", 200, priority=5))
    _step(e)
    s.add_request(_req("urgent", 12, priority=0, arrival=1.0))
    so = _step(e)
    assert so.num_scheduled_tokens == {"low": BUDGET - 12, "urgent": 12}
    run_to_completion(e)
    assert_all_free(e)


def test_a_less_important_request_gets_no_room():
    e = _engine("priority")
    s = e.scheduler
    s.add_request(_req("urgent_long", 200, priority=0))
    _step(e)
    s.add_request(_req("low", 8, priority=5, arrival=1.0))
    assert _step(e).num_scheduled_tokens == {"urgent_long": BUDGET}
    run_to_completion(e)
    assert_all_free(e)


def test_nothing_is_reserved_for_a_request_that_cannot_start():
    # One sequence slot, and the heavy request was admitted when both counters were level, so
    # the light one may not displace it: the heavy chunk keeps the whole budget.
    e = _engine("fair", max_num_seqs=1)
    s = e.scheduler
    s.add_request(_req("heavy", 200, tenant="heavy"))
    _step(e)
    s.add_request(_req("light", 8, tenant="light", arrival=1.0))
    assert not s.policy.displaces(s.waiting.peek(), s.running[0])
    so = _step(e)
    assert so.num_scheduled_tokens == {"heavy": BUDGET}
    run_to_completion(e)
    assert_all_free(e)


def test_fcfs_keeps_the_running_chunk_whole():
    e = _engine("fcfs")
    s = e.scheduler
    s.add_request(_req("first", 200))
    _step(e)
    s.add_request(_req("second", 8, arrival=1.0))
    assert _step(e).num_scheduled_tokens == {"first": BUDGET}
    run_to_completion(e)
    assert_all_free(e)
