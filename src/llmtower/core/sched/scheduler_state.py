"""What the scheduler holds between steps: its queues, its KV cache manager, its policy and
counters, and the two rules every part of it shares: when a request stops (``_check_stop``)
and how a request ends (``_finish``). The ``Scheduler`` (scheduler.py) is built on it, with one
mixin per job: admission.py, grammar.py, adapter_wait.py, preemption.py, step_output.py, apply_output.py and
stats.py."""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from llmtower.core.config import CacheConfig, SchedulerConfig
from llmtower.core.kv_cache.kv_cache_manager import KVCacheManager
from llmtower.core.kv_cache.relocator import BlockRelocator
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.degradation import DegradationConfig, DegradationController
from llmtower.core.sched.policy import make_policy
from llmtower.core.sched.spec_drafts import SpecDecodingStats
from llmtower.core.sched.step import Step
from llmtower.structured_output.manager import StructuredOutputManager

if TYPE_CHECKING:
    from llmtower.core.sched.adapter_wait import AdapterLoads


class SchedulerState:
    """Owns the waiting / running / swapped queues, the KV cache manager, the policy, the
    counters and every request from admission to its end."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig,
                 clock: Callable[[], float] = time.monotonic,
                 structured_output: StructuredOutputManager | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.clock = clock
        self.kv = KVCacheManager(cache_config)
        self.degradation = DegradationController(
            DegradationConfig(enabled=scheduler_config.enable_degradation,
                              compress_available=(scheduler_config.preemption_mode == "swap"
                                                  and self.kv.swap_layout.compressible)),
            clock=clock)
        # Block moves: every step under --kv-allocator relocator, and on demand (defragment()).
        self.relocator = BlockRelocator(self.kv.pool, cache_config.fragmentation_threshold,
                                        cache_config.max_block_moves_per_step)
        self.requests: dict[str, Request] = {}
        # The policy: the waiting queue's order and the preemption-victim rule.
        self.policy = make_policy(scheduler_config)
        self.waiting = self.policy.make_queue()
        self._num_added = 0  # admission sequence numbers (Request.seq)
        self.running: list[Request] = []
        self.swapped: deque[Request] = deque()
        self.finished_req_ids: set[str] = set()  # since the last schedule(), for the executor
        self._executor_has: set[str] = set()  # requests whose full data the executor holds
        # The longest sequence that can ever be in the KV cache at once.
        self.max_len = min(scheduler_config.max_model_len,
                           cache_config.num_blocks * cache_config.block_size)
        self.num_preemptions = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_rejected = 0
        self.num_steps = 0
        self.spec_stats = SpecDecodingStats()
        self._last = Step(0)  # the last step, for the statistics
        # Structured outputs: the grammar manager, requests whose grammar is still compiling
        # (outside `waiting`: they block nobody), requests that failed after admission, and
        # jump-forward tokens the executor has not seen yet.
        self.structured_output = structured_output
        self.waiting_for_grammar: dict[str, Request] = {}
        # LoRA: the executor's background adapter reads (set by the engine; None: adapters
        # are read before a request is added) and the requests waiting for theirs.
        self.adapter_loads: AdapterLoads | None = None
        self.waiting_for_adapter: dict[str, Request] = {}
        self._request_errors: list[tuple[str, str]] = []
        self._forced_token_ids: dict[str, list[int]] = {}

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        """Whether ``tok``, just appended, ends ``req``: EOS and stop token ids once min_tokens
        are out, max_tokens, the length cap."""
        sp = req.sampling_params
        num_tokens = len(req.all_token_ids)
        num_output = num_tokens - req.num_prompt_tokens
        if num_output >= sp.min_tokens:
            if tok == req.eos_token_id and not sp.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if num_output >= req.max_tokens or num_tokens >= self.max_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus, now: float | None = None) -> None:
        """End ``req`` (already off its queue) at ``now`` (default: the clock's now): free its
        blocks and grammar, forget it, and tell the executor at the next step if it holds the
        request's data."""
        if req.structured_output is not None:
            req.structured_output = None  # frees the matcher
            self._forced_token_ids.pop(req.request_id, None)
        req.status = status
        req.times.finished = self.clock() if now is None else now
        self.kv.free(req)
        del self.requests[req.request_id]
        self.policy.on_finish(req)
        if req.request_id in self._executor_has:
            self._executor_has.discard(req.request_id)
            self.finished_req_ids.add(req.request_id)
