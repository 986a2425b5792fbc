"""Helpers to drive the scheduler with the fake model."""
from __future__ import annotations

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor

EOS = 0


def make_engine(block_size=4, num_blocks=64, num_cpu_blocks=0, vocab_size=64, **sched_kw) -> EngineCore:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
                        enable_prefix_caching=sched_kw.pop("enable_prefix_caching", True))
    sched = Scheduler(SchedulerConfig(**sched_kw), cache)
    return EngineCore(sched, FakeExecutor(num_blocks, block_size, num_cpu_blocks, vocab_size))


def make_request(rid, prompt, max_tokens=8, priority=0, arrival=None, eos=EOS, **sp) -> Request:
    return Request(str(rid), list(prompt), SamplingParams(max_tokens=max_tokens, **sp),
                   eos_token_id=eos, priority=priority, arrival_time=arrival)


def run_to_completion(engine: EngineCore, max_steps=100_000) -> dict[str, list[int]]:
    """Step until no request is left; returns each request's output tokens."""
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    else:
        raise AssertionError("requests did not finish")
    run_to_completion.finish = finish
    return out


def assert_all_free(engine: EngineCore) -> None:
    s = engine.scheduler
    assert not s.requests and not s.running and not s.swapped and len(s.waiting) == 0
    assert not s.kv.req_to_blocks and not s.kv.req_to_cpu_blocks and not s.kv.num_cached_blocks
    pool = s.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert len(s.kv.free_cpu_blocks) == s.kv.num_cpu_blocks
