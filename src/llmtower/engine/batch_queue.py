"""The steps in flight under ``--async-scheduling``, and the thread that runs their forward passes.

vLLM v1's batch queue with two steps: the EngineCore submits step N+1 (already scheduled)
behind step N and then waits for step N's output, so the forward pass of one step overlaps
with scheduling the next and with turning the previous one's output into messages. One
worker thread runs the executor, so steps execute strictly in submission order: a step's KV
writes, swaps and block moves all happen before the next step starts, which is what lets the
scheduler free or hand out a block that a step in flight still writes (that step finishes
before any later step reads the block). On CPU the overlap comes from torch releasing the GIL
in its kernels while the main thread schedules.
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.executor.base import Executor

# Steps in flight at most: one running and one scheduled behind it (vLLM's batch queue size
# for async scheduling). More would only lengthen the stop-check lag.
MAX_STEPS_IN_FLIGHT = 2


class BatchQueue:
    """Owns the forward-pass worker thread and the submitted steps, oldest first."""

    def __init__(self, executor: Executor) -> None:
        self.executor = executor
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="llmtower-forward")
        self._in_flight: deque[tuple[SchedulerOutput, Future[ModelRunnerOutput]]] = deque()

    def __len__(self) -> int:
        return len(self._in_flight)

    @property
    def full(self) -> bool:
        return len(self._in_flight) >= MAX_STEPS_IN_FLIGHT

    def submit(self, scheduler_output: SchedulerOutput) -> None:
        """Queue a step behind those in flight; it runs when they are done."""
        future = self._pool.submit(self.executor.execute_model, scheduler_output)
        self._in_flight.append((scheduler_output, future))

    def oldest_done(self) -> bool:
        return bool(self._in_flight) and self._in_flight[0][1].done()

    def pop_oldest(self) -> tuple[SchedulerOutput, ModelRunnerOutput]:
        """Wait for the oldest step and take it off the queue (re-raises its failure)."""
        scheduler_output, future = self._in_flight[0]
        try:
            return scheduler_output, future.result()
        finally:
            self._in_flight.popleft()

    def wait_idle(self) -> None:
        """Wait until no forward pass runs (the outputs stay queued, to be popped): for work
        that touches the executor between steps, such as moving KV blocks."""
        for _, future in self._in_flight:
            future.exception()  # waits; a failure is raised when the step is popped

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._in_flight.clear()
