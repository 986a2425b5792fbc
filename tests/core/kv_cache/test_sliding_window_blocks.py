"""A model whose every layer has a sliding window: the KV cache manager returns a request's
blocks once they are wholly before its window, so a request holds about ceil(window /
block_size) + 1 blocks however long it runs; whatever the scheduler does (preemption by
recompute or swap, block relocation, prefix hits) the blocks inside the window stay intact
(the fake executor reads them back) and no block leaks."""
from __future__ import annotations

import math

import pytest

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor
from tests.core.sched_helpers import assert_all_free, make_request

BS, WINDOW = 4, 10
PROMPTS = [[1 + (i * 7 + j) % 60 for j in range(6 + 5 * i)] for i in range(8)]
SHARED = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49]  # 3 blocks, longer than the window
PREFIXED = [SHARED + [50 + i, 3, 4 + i] for i in range(4)]


def _engine(window: int | None, num_blocks: int = 256, num_cpu_blocks: int = 0,
            kv_allocator: str = "plain", **sched_kw) -> EngineCore:
    cache = CacheConfig(block_size=BS, num_blocks=num_blocks, num_cpu_blocks=num_cpu_blocks,
                        kv_allocator=kv_allocator, sliding_window=window)  # type: ignore[arg-type]
    sched = Scheduler(SchedulerConfig(**sched_kw), cache)
    return EngineCore(sched, FakeExecutor(num_blocks, BS, num_cpu_blocks, window=WINDOW))


def _run(engine: EngineCore, prompts, max_tokens: int) -> tuple[dict[str, list[int]], int]:
    """Outputs, and the most blocks a request held in a step that decodes it (a prefill
    step, recompute included, needs its whole chunk's blocks at once)."""
    for i, p in enumerate(prompts):
        engine.add_request(make_request(i, p, max_tokens=max_tokens, ignore_eos=True))
    sched, kv = engine.scheduler, engine.scheduler.kv
    most = 0
    schedule = sched.schedule

    def watched():
        nonlocal most
        so = schedule()
        for rid, n in so.num_scheduled_tokens.items():
            if n == 1:
                most = max(most, kv.num_blocks_of(rid))
        return so

    sched.schedule = watched  # type: ignore[method-assign]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for o in engine.step().outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out, most


CONDITIONS = {
    "ample": dict(),
    "recompute": dict(num_blocks=24, preemption_mode="recompute"),
    "swap": dict(num_blocks=24, num_cpu_blocks=64, preemption_mode="swap"),
    "relocator": dict(num_blocks=64, kv_allocator="relocator"),
    "chunked": dict(max_num_batched_tokens=8, long_prefill_token_threshold=4),
}


@pytest.mark.parametrize("condition", list(CONDITIONS))
def test_window_blocks_bounded_and_intact(condition):
    want, unbounded = _run(_engine(None), PROMPTS, 40)
    engine = _engine(WINDOW, **CONDITIONS[condition])
    got, most = _run(engine, PROMPTS, 40)
    assert got == want  # the window's blocks read back right, every step
    # the window's blocks, one more for the next token's, and one partly behind the window
    assert most <= math.ceil(WINDOW / BS) + 2 < unbounded
    assert_all_free(engine)
    assert not engine.scheduler.kv.num_dead_blocks
    if condition in ("recompute", "swap"):
        assert engine.scheduler.num_preemptions > 0


def test_prefix_hits_on_blocks_the_window_returned():
    """A request's blocks go back to the pool cached: a later request with the same prefix
    hits them (their content intact) until they are evicted."""
    want, _ = _run(_engine(None), PREFIXED, 12)
    engine = _engine(WINDOW)
    got, _ = _run(engine, PREFIXED[:1], 12)
    more, _ = _run(engine, PREFIXED[1:], 12)
    got.update({str(int(k) + 1): v for k, v in more.items()})
    assert got == want
    assert engine.scheduler.kv.prefix_cache_hits >= 3 * len(SHARED) - 3 * BS
    assert_all_free(engine)


def test_a_global_layer_keeps_every_block():
    """sliding_window None (some layer is global): blocks are never returned early."""
    engine = _engine(None)
    _, most = _run(engine, PROMPTS[-1:], 40)
    assert most == math.ceil((len(PROMPTS[-1]) + 40 - 1) / BS)  # the last token is not fed
