"""Test helpers for the engine's client side: a tiny EngineCore driven by the model-free
fake executor, so that the offline LLM can be tested without a model."""
from __future__ import annotations


def make_fake_engine_core(vocab_size: int, max_model_len: int = 128, num_blocks: int = 64,
                          block_size: int = 4, **sched_kw):
    """An EngineCore whose executor is the FakeExecutor (tokens in [0, vocab_size))."""
    from llmtower.core.config import CacheConfig, SchedulerConfig
    from llmtower.core.sched.scheduler import Scheduler
    from llmtower.engine.core import EngineCore
    from llmtower.executor.fake_executor import FakeExecutor

    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=0,
                        enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_model_len=max_model_len, **sched_kw), cache)
    return EngineCore(sched, FakeExecutor(num_blocks, block_size, 0, vocab_size))
