"""A run of plain decode steps applied in one pass (``advance_decode_steps``) leaves the
scheduler exactly where as many ``schedule()`` + ``update_from_output()`` rounds leave it:
tokens, block tables, the free list's order, the prefix cache, counters and finished outputs."""
from __future__ import annotations

import random

import pytest

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import ModelRunnerOutput
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler

TOK = 1


class Twin:
    """A scheduler with its own clock, stepped with TOK sampled for every request that
    reaches the end of its known tokens."""

    def __init__(self, policy: str, caching: bool, num_blocks: int) -> None:
        self.now = 0.0
        self.sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64,
                                               policy=policy),
                               CacheConfig(block_size=4, num_blocks=num_blocks,
                                           enable_prefix_caching=caching),
                               clock=lambda: self.now)
        self.finished: list[tuple[str, str | None, float]] = []

    def step(self) -> None:
        self.finish_step(self.sched.schedule())

    def finish_step(self, so) -> None:
        ids = list(so.num_scheduled_tokens)
        reqs = so.scheduled_requests
        sampled = [[TOK] if reqs[r].num_computed_tokens >= len(reqs[r].all_token_ids) else []
                   for r in ids]
        self.now += 1.0
        outs = self.sched.update_from_output(so, ModelRunnerOutput(ids, sampled))
        self.finished += [(o.request_id, o.finish_reason, self.now, _times(o))
                          for o in outs.outputs if o.finish_reason]

    def state(self) -> tuple:
        s = self.sched
        pool = s.kv.pool
        return ([(r.request_id, list(r.all_token_ids), r.num_computed_tokens, r.status,
                  r.times.first_token, r.times.last_token,
                  [b.block_id for b in s.kv.req_to_blocks.get(r.request_id, [])],
                  s.kv.num_cached_blocks.get(r.request_id), list(r.block_hashes))
                 for r in s.requests.values()],
                [r.request_id for r in s.running], [b.block_id for b in pool.free_queue],
                sorted((h, b.block_id) for h, b in pool.cached.items()), pool.num_evictions,
                s.num_steps, sorted(s.finished_req_ids), self.finished,
                s._last.scheduled, s._last.new_blocks)


def _times(o) -> tuple:
    """A finished output's timings on the scheduler's clock (its first token's time among
    them; the arrival is wall-clock time, different for each twin)."""
    m = o.metrics
    return m.prefill_time, m.decode_time, m.num_generation_tokens, m.num_cached_tokens


def _request(i: int, rng: random.Random) -> Request:
    prefix = [7] * 8 if i % 3 == 0 else []  # shared prompt blocks: prefix-cache hits
    prompt = prefix + [rng.randrange(2, 50) for _ in range(rng.randrange(1, 14))]
    if i % 4 == 0:  # ends on its EOS (TOK) once min_tokens are out
        sp = SamplingParams(max_tokens=40, min_tokens=rng.randrange(1, 12))
        return Request(str(i), prompt, sp, eos_token_id=TOK)
    return Request(str(i), prompt, SamplingParams(max_tokens=rng.randrange(1, 30),
                                                  ignore_eos=True), eos_token_id=TOK)


@pytest.mark.parametrize("policy,caching,num_blocks,seed,past_stops", [
    ("fcfs", True, 40, 0, False), ("priority", True, 24, 1, False), ("fcfs", False, 30, 2, False),
    ("sjf", True, 200, 3, False), ("fcfs", True, 40, 4, True), ("priority", True, 24, 5, True),
    ("fcfs", False, 30, 6, True), ("sjf", True, 200, 7, True)])
def test_runs_of_decode_steps_equal_step_by_step(policy, caching, num_blocks, seed, past_stops):
    """Runs cut at random points, ending at the first stop or (past_stops) going on past the
    steps in which requests stop, leave the scheduler as the steps one by one do."""
    rng = random.Random(seed)
    steps, bulk = Twin(policy, caching, num_blocks), Twin(policy, caching, num_blocks)
    applied = stops_inside = 0
    for i in range(40):
        for t in (steps, bulk):
            t.sched.add_request(_request(i, random.Random(seed * 100 + i)))
        for _ in range(rng.randrange(0, 12)):
            lasts = None
            if past_stops:
                shape = bulk.sched.decode_run_ahead(TOK)
                k = shape.num_steps
                lasts = shape.lasts  # the plan's stop steps, reused by the run
                stops_inside += sum(1 for s, _ in shape.stops if s < k)
            else:
                k = bulk.sched.decode_steps_ahead(TOK)
            if k >= 1 and rng.random() < 0.8:
                j = rng.randrange(1, k + 1)  # a run cut anywhere is still exact
                for _ in range(j):
                    steps.step()
                ends = [bulk.now + s for s in range(1, j + 1)]
                bulk.now += j
                run = bulk.sched.advance_decode_steps(j, TOK, ends if past_stops else None,
                                                      lasts=lasts)
                bulk.finished += [(o.request_id, o.finish_reason, ends[s - 1], _times(o))
                                  for o, s in zip(run.stopped, run.stop_steps)]
                applied += j
            else:
                steps.step()
                bulk.step()
            assert steps.state() == bulk.state()
    while steps.sched.requests:
        steps.step()
        bulk.step()
    assert steps.state() == bulk.state() and applied > 20
    assert not past_stops or stops_inside > 3


@pytest.mark.parametrize("policy,caching,num_blocks,seed", [
    ("fcfs", True, 40, 10), ("priority", True, 24, 11), ("fcfs", False, 30, 12),
    ("sjf", True, 200, 13)])
def test_runs_from_a_step_in_flight_equal_step_by_step(policy, caching, num_blocks, seed):
    """A run whose first step is the one schedule() just returned (admitting new requests
    among decodes), its outputs applied with the run, cut at random points, leaves the
    scheduler as the steps one by one do."""
    rng = random.Random(seed)
    steps, bulk = Twin(policy, caching, num_blocks), Twin(policy, caching, num_blocks)
    from_flight = 0
    for i in range(40):
        for t in (steps, bulk):
            t.sched.add_request(_request(i, random.Random(seed * 100 + i)))
        for _ in range(rng.randrange(1, 8)):
            so = bulk.sched.schedule()
            shape = bulk.sched.decode_run_ahead(TOK, in_flight=so)
            k = shape.num_steps
            if k >= 1:
                j = rng.randrange(1, k + 1)
                for _ in range(j):
                    steps.step()
                ends = [bulk.now + s for s in range(1, j + 1)]
                bulk.now += j
                # (Half of them with the plan's stop steps, half asking again.)
                run = bulk.sched.advance_decode_steps(j, TOK, ends, in_flight=so,
                                                      lasts=shape.lasts if i % 2 else None)
                bulk.finished += [(o.request_id, o.finish_reason, ends[s - 1], _times(o))
                                  for o, s in zip(run.stopped, run.stop_steps)]
                from_flight += 1
            else:
                steps.step()
                bulk.finish_step(so)
            assert steps.state() == bulk.state()
    while steps.sched.requests:
        steps.step()
        bulk.step()
    assert steps.state() == bulk.state() and from_flight > 10


def test_no_run_while_anything_but_decodes_is_due():
    t = Twin("fcfs", True, 40)
    t.sched.add_request(Request("a", [3] * 6, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert t.sched.decode_steps_ahead(TOK) == 0  # waiting
    t.step()  # its prefill, sampling its first token
    assert t.sched.decode_steps_ahead(TOK) == 4  # 4 more tokens, the last one ends it
    assert t.sched.decode_steps_ahead(TOK, limit=2) == 2
    t.sched.add_request(Request("b", [3] * 6, SamplingParams(max_tokens=5, ignore_eos=True)))
    assert t.sched.decode_steps_ahead(TOK) == 0
    t.step()
    # "c" samples its EOS every step: its next token ends it (min_tokens 2), so the run is
    # that one step.
    t.sched.add_request(Request("c", [4] * 3, SamplingParams(max_tokens=9, min_tokens=2),
                                eos_token_id=TOK))
    t.step()
    assert t.sched.decode_steps_ahead(TOK) == 1


def test_no_run_under_a_sliding_window():
    """A windowed model frees the blocks that leave the window as decode proceeds: a run that
    skipped those steps would hold blocks a step-by-step run has returned, so none is planned
    (the same request without a window gets one)."""
    ahead = {}
    for window in (None, 8):
        now = [0.0]
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64),
                          CacheConfig(block_size=4, num_blocks=40, sliding_window=window),
                          clock=lambda now=now: now[0])
        sched.add_request(Request("a", [3] * 6, SamplingParams(max_tokens=12, ignore_eos=True)))
        so = sched.schedule()
        now[0] += 1.0
        sched.update_from_output(so, ModelRunnerOutput(list(so.num_scheduled_tokens), [[TOK]]))
        ahead[window] = sched.decode_steps_ahead(TOK)
    assert ahead == {None: 11, 8: 0}
