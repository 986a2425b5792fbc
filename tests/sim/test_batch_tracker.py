"""The BatchTracker's view of each step, kept only from SchedulerOutput deltas, agrees with the
scheduler's own state: chunked prefills (down to 1-token chunks), prefix hits, preemption by
recompute and by swap."""
from __future__ import annotations

import random

import pytest

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.outputs import ModelRunnerOutput
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.sim.batch_tracker import SAMPLED, BatchTracker


@pytest.mark.parametrize("mode, budget, blocks, prefix", [
    ("recompute", 7, 24, True),
    ("recompute", 64, 40, False),
    ("swap", 13, 24, True),
    ("swap", 200, 30, False),
])
def test_tracker_matches_the_scheduler_step_by_step(mode, budget, blocks, prefix):
    rng = random.Random(budget)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=budget, max_model_len=256, max_num_seqs=8,
                        preemption_mode=mode, max_num_partial_prefills=2),
        CacheConfig(block_size=4, num_blocks=blocks, num_cpu_blocks=64,
                    enable_prefix_caching=prefix))
    shared = [rng.randrange(50) for _ in range(12)]
    for i in range(30):
        own = [rng.randrange(50) for _ in range(rng.randint(1, 30))]
        prompt = (shared if i % 3 == 0 else []) + own
        sched.add_request(Request(str(i), prompt, SamplingParams(
            max_tokens=rng.randint(1, 12), ignore_eos=True), arrival_time=float(i)))
    tracker = BatchTracker()
    checked = partial_seen = 0
    for _ in range(5000):
        if not sched.has_unfinished_requests():
            break
        so = sched.schedule()
        shape = tracker.step(so)
        reqs = {rid: sched.requests[rid] for rid in shape.req_ids}
        assert set(shape.req_ids) == set(so.num_scheduled_tokens)
        kv = attn = 0
        for rid, sampled in zip(shape.req_ids, shape.sampled_token_ids):
            r, n = reqs[rid], so.num_scheduled_tokens[rid]
            done = r.num_computed_tokens >= r.num_tokens  # after schedule(): caught up or not
            assert (sampled is SAMPLED) == done
            partial_seen += not done
            kv += r.num_computed_tokens
            before = r.num_computed_tokens - n
            attn += n * before + n * (n + 1) // 2
            checked += 1
        assert (shape.kv_tokens, shape.attn_pairs) == (kv, attn)
        assert shape.num_sampled == sum(s is SAMPLED for s in shape.sampled_token_ids)
        assert shape.num_tokens == so.total_num_scheduled_tokens
        sched.update_from_output(so, ModelRunnerOutput(shape.req_ids, shape.sampled_token_ids))
    assert not sched.has_unfinished_requests()
    assert checked > 100 and sched.num_preemptions > 0
    assert partial_seen > 0 or budget > 30  # small budgets cut prompts into chunks
