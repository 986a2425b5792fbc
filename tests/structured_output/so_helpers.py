"""Helpers for structured-output tests: a scheduler + fake executor wired to an xgrammar
manager over the project's tiny tokenizer (vocabulary 512, EOS <|im_end|> = 2)."""
from __future__ import annotations

import threading
from typing import Any

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.request import Request
from llmtower.core.sampling_params import SamplingParams
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.core import EngineCore
from llmtower.executor.fake_executor import FakeExecutor
from llmtower.structured_output.backend_xgrammar import XgrammarBackend
from llmtower.structured_output.manager import StructuredOutputManager, StructuredOutputsConfig

VOCAB = 512
EOS = 2  # <|im_end|> in tests/fixtures/tiny_models.py


class GatedBackend:
    """An XgrammarBackend whose compiles wait for ``gate`` (a slow compile on demand)."""

    def __init__(self, inner: XgrammarBackend, gate: threading.Event) -> None:
        self.inner = inner
        self.gate = gate

    def compile(self, params: Any) -> Any:
        self.gate.wait(timeout=30)
        return self.inner.compile(params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def make_manager(tokenizer: Any, gate: threading.Event | None = None,
                 **config: Any) -> StructuredOutputManager:
    def factory() -> Any:
        backend = XgrammarBackend(tokenizer, VOCAB, [EOS])
        return GatedBackend(backend, gate) if gate is not None else backend
    return StructuredOutputManager(StructuredOutputsConfig(**config), factory)


def make_engine(tokenizer: Any, num_blocks: int = 256, block_size: int = 4,
                manager: StructuredOutputManager | None = None, **sched_kw: Any) -> EngineCore:
    cache = CacheConfig(block_size=block_size, num_blocks=num_blocks, num_cpu_blocks=
                        sched_kw.pop("num_cpu_blocks", 0), enable_prefix_caching=True)
    sched_kw.setdefault("max_model_len", 512)
    sched = Scheduler(SchedulerConfig(**sched_kw), cache,
                      structured_output=manager or make_manager(tokenizer))
    return EngineCore(sched, FakeExecutor(num_blocks, block_size, cache.num_cpu_blocks, VOCAB))


def request(rid: str, prompt: list[int], so: dict | None = None, max_tokens: int = 64,
            **sp: Any) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, structured_outputs=so, **sp),
                   eos_token_id=EOS)


def run(engine: EngineCore, max_steps: int = 20_000) -> tuple[dict[str, list[int]],
                                                             dict[str, str], list]:
    """Step to the end: (output tokens, finish reasons, request errors) per request id."""
    out: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    errors: list[tuple[str, str]] = []
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return out, finish, errors
        step = engine.step()
        errors += step.request_errors
        for o in step.outputs:
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason:
                finish[o.request_id] = o.finish_reason
    raise AssertionError("requests did not finish")


def text_of(tokenizer: Any, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != EOS], skip_special_tokens=False)
