"""The scheduler's structured-output glue: a constrained request waits outside ``waiting``
until its grammar has compiled (it blocks nobody), joins the queue when it has, and ends with
an error when it failed; every token it samples advances its grammar's matcher, which may end
it or append jump-forward tokens for the next step to compute."""
from __future__ import annotations

from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.scheduler_state import SchedulerState

# With only grammar-waiting requests, schedule() waits this long for a compile to finish.
GRAMMAR_WAIT_S = 0.01


class GrammarMixin(SchedulerState):
    """The scheduler's part in structured outputs (the manager owns the grammars)."""

    def _start_grammar(self, request: Request) -> bool:
        """Start compiling a constrained request's grammar; True when no wait is needed."""
        if request.sampling_params.structured_outputs is None:
            return True
        if self.structured_output is None:
            raise ValueError("structured_outputs are not available in this engine (it was "
                             "built without a grammar backend); remove them from the request")
        return self.structured_output.add_request(request)

    def _admit_compiled_grammars(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; those whose grammar
        failed or timed out end here (their client gets a 400). With nothing else to run,
        wait a little for a compile rather than spin."""
        so = self.structured_output
        assert so is not None
        if not (self.running or self.waiting or self.swapped):
            so.wait(self.waiting_for_grammar, GRAMMAR_WAIT_S)
        ready, failed = so.poll(self.waiting_for_grammar)
        for req in ready:
            del self.waiting_for_grammar[req.request_id]
            req.status = RequestStatus.WAITING
            self.waiting.add(req)
        for req, why in failed:
            del self.waiting_for_grammar[req.request_id]
            self.num_rejected += 1
            self._request_errors.append((req.request_id, why))
            self._finish(req, RequestStatus.FINISHED_REJECTED)

    def _advance_grammar(self, req: Request, tok: int, status: RequestStatus | None,
                         new_tokens: list[int]) -> RequestStatus | None:
        """Advance the matcher by a newly appended token; a terminated grammar finishes the
        request ("stop"). Jump-forward tokens are appended here, for the next step to compute."""
        so = self.structured_output
        assert so is not None
        if so.accept_token(req, tok):
            return status or RequestStatus.FINISHED_STOPPED
        if status is not None:
            return status
        forced = so.jump_forward_tokens(req)
        for t in forced:
            req.all_token_ids.append(t)
            new_tokens.append(t)
            status = self._check_stop(req, t)
            if status is not None:
                return status  # finishing: the executor never needs them
        if forced:
            self._forced_token_ids.setdefault(req.request_id, []).extend(forced)
        return None

    def take_request_errors(self) -> list[tuple[str, str]]:
        """(request id, why) of requests that failed after admission, since the last call."""
        errors, self._request_errors = self._request_errors, []
        return errors
