"""EngineCore: one Scheduler next to one Executor, stepping them in a loop.

Used in-process by the offline ``LLM`` and wrapped by ``EngineCoreProc`` for serving.

By default a step is strictly serial: schedule, forward pass, update. Under
``--async-scheduling`` (an ``AsyncScheduler`` and a ``BatchQueue``) step N+1 is scheduled and
submitted while step N's forward pass runs on the batch queue's worker thread, and step N's
output is turned into messages while step N+1 runs; see ``core/sched/async_scheduler.py`` for
how the one-step lag stays exact.
"""
from __future__ import annotations

import time

from llmtower.core.kv_cache.relocator import DefragResult
from llmtower.engine.preload import PreloadStatus, PreloadTracker
from llmtower.core.kv_cache.snapshot import KVCacheSnapshot, take_kv_cache_snapshot
from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.core.request import Request
from llmtower.core.sched.async_scheduler import AsyncScheduler
from llmtower.core.sched.scheduler import Scheduler
from llmtower.engine.batch_queue import BatchQueue
from llmtower.engine.model_info import ModelInfo
from llmtower.executor.base import Executor
from llmtower.lora import engine_ops as lora_ops
from llmtower.lora.request import LoRARequest


class EngineCore:
    """Owns the scheduler and the executor; ``step()`` is schedule → execute → update."""

    def __init__(self, scheduler: Scheduler, executor: Executor,
                 model_info: ModelInfo | None = None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        # --async-scheduling: an AsyncScheduler gets a batch queue (forward passes on a worker
        # thread, two steps in flight); a plain Scheduler steps serially.
        self.batch_queue = BatchQueue(executor) if isinstance(scheduler, AsyncScheduler) else None
        # The loaded model's facts (None for test and simulated executors without a model).
        self.model_info = model_info
        self.last_step_seconds = 0.0
        self.last_step_num_tokens = 0  # scheduled tokens of the last step (for metrics)
        self.last_schedule_seconds = 0.0  # schedule() alone, of the last step
        self.preloads = PreloadTracker(scheduler)  # llmtower preload / --preload-prompts
        # LoRA: a request's adapter is read on the executor's background thread while the
        # request waits in the scheduler (core/sched/adapter_wait.py).
        if hasattr(executor, "start_lora_load"):
            scheduler.adapter_loads = executor  # type: ignore[assignment]

    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises AdmissionError / QueueFullError / ValueError; the request is then not queued."""
        if self.batch_queue is not None and req.sampling_params.structured_outputs is not None:
            # A grammar's mask for step N+1 needs step N's token, which is not known when
            # step N+1 is scheduled.
            raise ValueError("structured outputs are not supported with --async-scheduling "
                             "(async_scheduling=True): run the engine without it to use them")
        if req.lora_request is not None and self.scheduler.adapter_loads is None:
            self.add_lora(req.lora_request)  # checked (and read) before the request queues
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_id=req.eos_token_id, priority=req.priority,
            arrival_time=req.arrival_time or None, cache_salt=req.cache_salt, tenant=req.tenant,
            lora_request=req.lora_request))

    def add_lora(self, lora_request: LoRARequest | dict) -> bool:
        """Load a LoRA adapter (vLLM's ``add_lora``); ValueError with the reason when LoRA
        is off or the adapter cannot be served on this model."""
        return lora_ops.add_lora(self.executor, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """Unload an adapter; refused (ValueError) while requests use it."""
        return lora_ops.remove_lora(self.executor, self.scheduler, lora_id)

    def list_loras(self) -> list[int]:
        return lora_ops.list_loras(self.executor)

    def abort_requests(self, request_ids) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if self.batch_queue is not None:
            return self._step_async(self.batch_queue)
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        # The scheduling decision alone (llmtower:scheduler_step_delay_seconds).
        self.last_schedule_seconds = time.perf_counter() - t0
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if scheduler_output.total_num_scheduled_tokens == 0 and not (
                scheduler_output.blocks_to_swap_out or scheduler_output.finished_req_ids):
            return EngineCoreOutputs(timestamp=time.monotonic(),
                                     request_errors=self.scheduler.take_request_errors())
        model_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.preloads.active:  # preload requests' tokens never leave the engine
            self.preloads.filter_outputs(outputs)
        # Requests that failed after admission (a grammar that did not compile in time).
        outputs.request_errors = self.scheduler.take_request_errors()
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def _step_async(self, queue: BatchQueue) -> EngineCoreOutputs:
        """Schedule and submit the next step, then apply the oldest step in flight; the first
        call after a pause submits without waiting, so that two steps are in flight."""
        t0 = time.perf_counter()
        self.last_step_num_tokens = 0
        submitted = False
        if self.scheduler.has_unfinished_requests() and not queue.full:
            scheduler_output = self.scheduler.schedule()
            self.last_schedule_seconds = time.perf_counter() - t0
            if scheduler_output.total_num_scheduled_tokens or (
                    scheduler_output.blocks_to_swap_out or scheduler_output.finished_req_ids):
                self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
                queue.submit(scheduler_output)
                submitted = True
        if not queue or (submitted and not queue.full and not queue.oldest_done()):
            return EngineCoreOutputs(timestamp=time.monotonic(),
                                     request_errors=self.scheduler.take_request_errors())
        scheduler_output, model_output = queue.pop_oldest()
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        if self.preloads.active:
            self.preloads.filter_outputs(outputs)
        outputs.request_errors = self.scheduler.take_request_errors()
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def update_priority(self, request_ids: list[str], priority: int) -> int:
        """Set the priority of these requests (e.g. the samples of one n > 1 request);
        returns how many were still unfinished."""
        return sum(self.scheduler.update_priority(rid, priority) for rid in request_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget the prefix cache; False (nothing done) while requests hold KV blocks."""
        return self.scheduler.reset_prefix_cache()

    def preload(self, prompts: list[list[int]], pin: bool = False,
                cache_salt: str | None = None) -> PreloadStatus:
        """Queue prompts whose KV goes into the prefix cache (and, with ``pin``, stays there);
        they run between other requests. Poll ``preload_status(batch_id)`` for the end."""
        if not self.scheduler.kv.enable_prefix_caching:
            raise ValueError("prefix caching is disabled (--no-enable-prefix-caching), so a "
                             "preloaded prompt could never be reused: enable it to preload")
        return self.preloads.add(prompts, pin, cache_salt)

    def preload_status(self, batch_id: int) -> PreloadStatus:
        return self.preloads.status(batch_id)

    def unpin(self) -> int:
        """Release every pinned prefix block (they stay cached, evictable again)."""
        return self.scheduler.kv.pinned.unpin_all()

    def defragment(self) -> DefragResult:
        """A full KV defragmentation between two steps: the scheduler relabels its blocks, the
        executor moves their K/V and remaps its block tables before the next forward pass."""
        moves, result = self.scheduler.defragment()
        if moves:
            if self.batch_queue is not None:  # no forward pass may run while blocks move
                self.batch_queue.wait_idle()
            self.executor.apply_block_moves(moves)  # type: ignore[attr-defined]
        return result

    def kv_cache_snapshot(self) -> KVCacheSnapshot:
        """Every KV block's state, the block tables and fragmentation (operator tools)."""
        return take_kv_cache_snapshot(self.scheduler)

    def shutdown(self) -> None:
        if self.batch_queue is not None:
            self.batch_queue.shutdown()
        self.executor.shutdown()
