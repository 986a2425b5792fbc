"""EngineCore: one Scheduler next to one Executor, stepping them in a loop.

Used in-process by the offline ``LLM`` and wrapped by ``EngineCoreProc`` for serving.
"""
from __future__ import annotations

import time

from llmtower.core.outputs import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from llmtower.core.request import Request
from llmtower.core.sched.scheduler import Scheduler
from llmtower.executor.base import Executor


class EngineCore:
    """Owns the scheduler and the executor; ``step()`` is schedule → execute → update."""

    def __init__(self, scheduler: Scheduler, executor: Executor) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.last_step_seconds = 0.0
        self.last_step_num_tokens = 0  # scheduled tokens of the last step (for metrics)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises AdmissionError / QueueFullError / ValueError; the request is then not queued."""
        self.scheduler.add_request(Request(
            req.request_id, req.prompt_token_ids, req.sampling_params,
            eos_token_id=req.eos_token_id, priority=req.priority,
            arrival_time=req.arrival_time or None, cache_salt=req.cache_salt))

    def abort_requests(self, request_ids) -> list[str]:
        return self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs()
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        self.last_step_num_tokens = scheduler_output.total_num_scheduled_tokens
        if scheduler_output.total_num_scheduled_tokens == 0 and not (
                scheduler_output.blocks_to_swap_out or scheduler_output.finished_req_ids):
            return EngineCoreOutputs(timestamp=time.monotonic())
        model_output = self.executor.execute_model(scheduler_output)
        outputs = self.scheduler.update_from_output(scheduler_output, model_output)
        self.last_step_seconds = time.perf_counter() - t0
        return outputs

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.get_stats()

    def reset_prefix_cache(self) -> None:
        self.scheduler.reset_prefix_cache()

    def shutdown(self) -> None:
        self.executor.shutdown()
