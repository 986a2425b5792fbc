"""Picklable engine factories for the engine-process tests: a model-free EngineCore (the
fake executor) that ``EngineCoreProc`` can build in its spawned process, and one that fails."""
from __future__ import annotations

import time

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.args import EngineArgs
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor

BLOCK_SIZE = 4
NUM_BLOCKS = 64
MAX_MODEL_LEN = 128
VOCAB_SIZE = 64


def make_fake_engine(args: EngineArgs) -> EngineCore:
    """The scheduler and fake executor, sized from the few engine args a test sets."""
    cache = CacheConfig(block_size=BLOCK_SIZE, num_blocks=args.num_gpu_blocks or NUM_BLOCKS)
    sched = Scheduler(SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len or MAX_MODEL_LEN,
        max_num_queued_reqs=args.max_num_queued_reqs, policy=args.policy), cache)
    return EngineCore(sched, FakeExecutor(cache.num_blocks, BLOCK_SIZE, vocab_size=VOCAB_SIZE))


class _SlowExecutor(FakeExecutor):
    def execute_model(self, so):
        time.sleep(0.01)  # a step long enough that a test can act between two of them
        return super().execute_model(so)


def make_slow_fake_engine(args: EngineArgs) -> EngineCore:
    engine = make_fake_engine(args)
    engine.executor = _SlowExecutor(engine.scheduler.cache_config.num_blocks, BLOCK_SIZE,
                                    vocab_size=VOCAB_SIZE)
    return engine


def make_failing_engine(args: EngineArgs) -> EngineCore:
    raise RuntimeError("weights not found: /nowhere/model.safetensors")
