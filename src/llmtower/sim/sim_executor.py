"""The simulated executor: the Executor interface, with a cost model instead of a model."""
from __future__ import annotations

from llmtower.core.outputs import ModelRunnerOutput, SchedulerOutput
from llmtower.sim.batch_tracker import BatchTracker
from llmtower.sim.clock import VirtualClock
from llmtower.sim.cost_model import CostModel


class SimExecutor:
    """Owns a replica's batch tracker and its virtual clock: ``execute_model`` samples the
    constant token 1 for every request that reaches the end of its known tokens (requests run
    with ``ignore_eos`` and ``max_tokens`` = the trace's output length, so the scheduler ends
    each one at exactly its length) and advances the clock by the predicted step time.

    It plugs into an ``EngineCore`` like any executor; the simulator drives it per replica.
    """

    def __init__(self, cost_model: CostModel, clock: VirtualClock | None = None) -> None:
        self.cost_model = cost_model
        self.clock = clock if clock is not None else VirtualClock()
        self.tracker = BatchTracker()
        self.num_steps = 0
        self.busy_s = 0.0
        self.last_step_s = 0.0

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        shape = self.tracker.step(scheduler_output)
        dt = self.cost_model.step_time(shape.num_tokens, shape.num_sampled, shape.attn_pairs,
                                       shape.kv_tokens, shape.num_seqs, shape.num_swapped_blocks)
        self.clock.now += dt
        self.num_steps += 1
        self.busy_s += dt
        self.last_step_s = dt
        return ModelRunnerOutput(shape.req_ids, shape.sampled_token_ids)

    def forget(self, req_ids) -> None:
        """Drop finished requests the scheduler reported in a step that ran nothing."""
        self.tracker.forget(req_ids)

    def shutdown(self) -> None:
        pass
