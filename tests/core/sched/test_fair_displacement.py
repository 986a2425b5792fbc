"""``--policy fair``: when a waiting request displaces a running one of another tenant, and how
much credit a returning tenant gets (issue 17). Deterministic, scheduler level, fake model.

- Displacement also reads the tenants' *live* counters (with a margin of one step's budget):
  before, only a running request's rank counted, its tenant's counter when it was admitted,
  so a flood's long requests admitted long ago could not be displaced however much the flood
  was served since.
- A request already preempted once is protected by its own tokens: two long requests never
  displace each other in turn for ever.
- A returning tenant gets credit only against tenants with requests waiting, capped by what
  they were served in their current busy period: a flood returning while a light tenant runs
  one request no longer makes the light tenant's next arrivals wait behind a step's budget
  of the flood.
"""
from __future__ import annotations

from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from tests.core.sched_helpers import assert_all_free, make_engine, run_to_completion


def _req(rid: str, tenant: str, prompt_len: int = 8, max_tokens: int = 50,
         arrival: float = 0.0) -> Request:
    return Request(rid, [(5 * i + len(rid)) % 50 + 1 for i in range(prompt_len)],
                   SamplingParams(max_tokens=max_tokens, ignore_eos=True), eos_token_id=0,
                   arrival_time=arrival, tenant=tenant)


def _steps_until_scheduled(engine, rid: str, limit: int) -> int:
    for k in range(1, limit + 1):
        so = engine.scheduler.schedule()
        engine.scheduler.update_from_output(so, engine.executor.execute_model(so))
        if rid in so.num_scheduled_tokens:
            return k
    return limit + 1


def _run(engine, steps: int) -> None:
    for _ in range(steps):
        so = engine.scheduler.schedule()
        engine.scheduler.update_from_output(so, engine.executor.execute_model(so))


def test_light_request_displaces_a_flood_request_admitted_long_ago():
    # Three slots: the light tenant's long request holds one (it stays active, so it is never
    # lifted), the flood's long requests hold the other two. After 300 steps the flood has
    # been served about 600 tokens, the light tenant about 320, and the light tenant's second
    # request arrives. Before: the flood's requests ranked at their counter when admitted (~0),
    # below the light tenant's 320, so the light request waited until one of them finished
    # (~300 more steps). Now the flood's live counter is more than a step's budget above.
    e = make_engine(policy="fair", num_blocks=512, block_size=4, max_num_seqs=3,
                    max_num_batched_tokens=64, max_model_len=1024, enable_prefix_caching=False)
    s = e.scheduler
    s.add_request(_req("light-long", "light", max_tokens=900))
    _run(e, 1)
    for i in range(6):
        s.add_request(_req(f"h{i}", "heavy", max_tokens=600, arrival=1.0))
    _run(e, 300)
    c = s.policy.counters
    assert c["heavy"] - c["light"] > 64 + 64  # served more by well over the margin
    assert {r.request_id for r in s.running} == {"light-long", "h0", "h1"}
    s.add_request(_req("light-2", "light", max_tokens=5, arrival=2.0))
    assert _steps_until_scheduled(e, "light-2", 400) == 1
    assert s.num_preemptions == 1  # one flood request made room
    run_to_completion(e)
    assert_all_free(e)


def test_flood_returning_while_the_light_tenant_runs_gets_no_credit_over_it():
    # The light tenant was served alone (its counter ~2,900), went idle, came back with one
    # request; then the flood returns with a burst. Before, the flood was lifted to the light
    # counter less one step's budget (256) and the light tenant's next request waited until
    # the flood had been served those 256 tokens (~110 steps at two slots). Now it gets no
    # credit over a tenant with nothing waiting.
    e = make_engine(policy="fair", num_blocks=512, block_size=4, max_num_seqs=2,
                    max_num_batched_tokens=256, max_model_len=512, enable_prefix_caching=False)
    s = e.scheduler
    for i in range(50):
        s.add_request(_req(f"l{i}", "light"))
    run_to_completion(e)
    s.add_request(_req("l-back", "light", arrival=1.0))
    _run(e, 2)
    for i in range(30):
        s.add_request(_req(f"h{i}", "heavy", arrival=2.0))
    _run(e, 3)
    s.add_request(_req("l-next", "light", arrival=3.0))
    waited = _steps_until_scheduled(e, "l-next", 200)
    assert waited <= 52  # at most until a slot frees (50-token requests), not 256 tokens of flood
    run_to_completion(e)
    assert_all_free(e)


def test_two_tenants_with_long_requests_do_not_displace_each_other_for_ever():
    # One slot, recompute, requests far longer than twice the margin: with live counters alone
    # each one would be displaced as soon as its own service put its tenant a margin ahead,
    # and restart from scratch. A request preempted once is protected by its own tokens.
    e = make_engine(policy="fair", num_blocks=256, block_size=4, max_num_seqs=1,
                    max_num_batched_tokens=16, max_model_len=256, enable_prefix_caching=False)
    s = e.scheduler
    for i in range(3):
        s.add_request(_req(f"a{i}", "a", max_tokens=150, arrival=float(i)))
        s.add_request(_req(f"b{i}", "b", max_tokens=150, arrival=float(i)))
    out = run_to_completion(e, max_steps=6 * 200)
    assert all(len(v) == 150 for v in out.values()) and len(out) == 6
    assert s.num_preemptions <= 6  # each request displaced at most about once
    assert_all_free(e)
