"""The scheduler under ``--async-scheduling`` (vLLM v1's ``AsyncScheduler``).

Step N+1 is scheduled while step N's forward pass runs, so the tokens step N samples are not
known yet when the scheduler decides step N+1. Each request that a step will sample for gets
one *output placeholder* when the step is scheduled: ``Request.num_output_placeholders``
counts it in ``num_tokens_with_placeholders``, which is what the one rule of the scheduler
(``num_computed_tokens`` catches up with the number of tokens) compares against. A decode is
therefore scheduled for a token the scheduler has not seen; the model runner, which processes
steps in order, feeds that token itself from the previous step's sampling.

When the step's output arrives its placeholders are resolved (the real tokens are appended by
``Scheduler.update_from_output``). Stop conditions are checked then, one step late: a request
that stops on a token of step N may already be in step N+1, whose extra token is discarded
because the request is finished by then. A request whose in-flight token is its last by length
(``max_tokens``, the context length) is never scheduled again (``Scheduler._at_length_cap``).
"""
from __future__ import annotations

from llmtower.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from llmtower.core.sched.scheduler import Scheduler
from llmtower.core.sched.step import Step


class AsyncScheduler(Scheduler):
    """Owns, beyond ``Scheduler``, the output placeholders of the steps in flight: added when a
    step that samples for a request is scheduled, resolved when that step's output is applied."""

    def _build_output(self, step: Step) -> SchedulerOutput:
        out = super()._build_output(step)
        sched_reqs = out.scheduled_requests
        placeholders = out.placeholder_req_ids
        for rid in out.num_scheduled_tokens:
            req = sched_reqs[rid]
            # The step computes up to the end of the sequence, so it samples the next token.
            if req.num_computed_tokens >= req.num_tokens_with_placeholders:
                req.num_output_placeholders += 1
                placeholders.append(rid)
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: ModelRunnerOutput) -> EngineCoreOutputs:
        # Resolve this step's placeholders first: the tokens that replace them are appended
        # below (or dropped, for a request that finished since the step was scheduled).
        sched_reqs = scheduler_output.scheduled_requests
        for rid in scheduler_output.placeholder_req_ids:
            sched_reqs[rid].num_output_placeholders -= 1
        return super().update_from_output(scheduler_output, model_runner_output)
