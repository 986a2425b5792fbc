"""The executor interface: what the EngineCore needs from whatever runs the model."""
from __future__ import annotations

from typing import Protocol

from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs one scheduled step: performs the block swaps/copies listed in the
    ``SchedulerOutput``, then one forward pass over all scheduled tokens, then sampling."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None: ...
