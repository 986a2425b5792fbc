"""Admission: a new request joins ``waiting`` (or waits for its grammar or adapter) or is refused at
once with an error that says what to change; aborts and priority changes of requests in any
state. Which waiting requests *run* is the step's decision (scheduler.py)."""
from __future__ import annotations

from collections.abc import Iterable

from llmtower.core.errors import AdmissionError, QueueFullError
from llmtower.core.request import Request, RequestStatus
from llmtower.core.sched.adapter_wait import AdapterWaitMixin
from llmtower.core.sched.grammar import GrammarMixin


class AdmissionMixin(GrammarMixin, AdapterWaitMixin):
    """The scheduler's front door: ``add_request``, ``abort_requests``, ``update_priority``."""

    def add_request(self, request: Request) -> None:
        """Admit a request to ``waiting``, or raise: AdmissionError if it can never run
        (HTTP 400), QueueFullError if the queue limits are reached (HTTP 429)."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request id {rid!r} is already in use; request ids must be unique")
        try:
            self._check_can_run(request)
            if not self.requests:
                self.degradation.on_idle()
            self.degradation.check_admission(rid)  # heavy KV pressure (level 4) sheds new work
            self._check_queue_room(request)
        except (AdmissionError, QueueFullError):
            self.num_rejected += 1
            raise
        # Generation stops at the context length or when the sequence would outgrow the cache.
        room = self.max_len - request.num_prompt_tokens
        asked = request.sampling_params.max_tokens
        request.max_tokens = room if asked is None else min(asked, room)
        adapter_ready = self._start_adapter(request)  # raises ValueError when LoRA is off
        grammar_ready = self._start_grammar(request)  # raises ValueError for a bad grammar
        request.status = RequestStatus.WAITING
        request.times.queued = self.clock()
        self._num_added += 1
        request.seq = self._num_added
        request.sort_key = ()
        self.requests[rid] = request
        self.policy.on_add(request)
        if not adapter_ready:  # waits outside the queue until its adapter is read
            request.status = RequestStatus.WAITING_FOR_ADAPTER
            self.waiting_for_adapter[rid] = request
            return
        if not grammar_ready:  # waits outside the queue until its grammar has compiled
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self.waiting_for_grammar[rid] = request
            return
        self.waiting.add(request)

    def _check_can_run(self, request: Request) -> None:
        """AdmissionError if ``request`` can never run here, whatever else is running."""
        cfg = self.config
        rid = request.request_id
        if request.priority != 0 and not self.policy.uses_priority:
            raise AdmissionError(
                f"request {rid!r} has priority={request.priority} but the scheduler policy is "
                f"{cfg.policy!r}; priorities need --policy priority")
        min_len = request.num_prompt_tokens + max(1, request.sampling_params.min_tokens)
        if min_len > cfg.max_model_len:
            raise AdmissionError(
                f"request {rid!r} needs {min_len} tokens ({request.num_prompt_tokens} prompt + "
                f"{max(1, request.sampling_params.min_tokens)} to generate) but max_model_len is "
                f"{cfg.max_model_len}{_because(cfg.max_model_len_reason)}; shorten the prompt "
                "or lower min_tokens")
        capacity = self.cache_config.num_blocks * self.cache_config.block_size
        if min_len > capacity:
            raise AdmissionError(
                f"request {rid!r} needs {min_len} tokens but the whole KV cache holds only "
                f"{capacity} ({self.cache_config.num_blocks} blocks of "
                f"{self.cache_config.block_size}); give the KV cache more memory")
        if cfg.max_num_queued_tokens and request.num_tokens > cfg.max_num_queued_tokens:
            raise AdmissionError(
                f"request {rid!r} has {request.num_tokens} prompt tokens, more than the waiting "
                f"queue may ever hold (max_num_queued_tokens={cfg.max_num_queued_tokens}); "
                "shorten the prompt")

    def _check_queue_room(self, request: Request) -> None:
        """QueueFullError if the waiting queue's limits leave no room for ``request`` now."""
        cfg = self.config
        if cfg.max_num_queued_reqs and len(self.waiting) >= cfg.max_num_queued_reqs:
            raise QueueFullError(f"the waiting queue is full ({len(self.waiting)} requests, "
                                 f"max_num_queued_reqs={cfg.max_num_queued_reqs}); retry later")
        if (cfg.max_num_queued_tokens
                and self.waiting.num_tokens + request.num_tokens > cfg.max_num_queued_tokens):
            raise QueueFullError(
                f"the waiting queue holds {self.waiting.num_tokens} prompt tokens and this "
                f"request adds {request.num_tokens}, over max_num_queued_tokens="
                f"{cfg.max_num_queued_tokens}; retry later")

    def abort_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Abort requests in any state; unknown or already finished ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.SWAPPED:
                self.swapped.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                del self.waiting_for_grammar[rid]
            elif req.status == RequestStatus.WAITING_FOR_ADAPTER:
                del self.waiting_for_adapter[rid]  # its read, if any, still fills the cache
            else:
                self.waiting.remove(req)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            aborted.append(rid)
        return aborted

    def update_priority(self, request_id: str, priority: int) -> bool:
        """Change a request's priority in any state; False if it is unknown or finished.

        Waiting: re-keyed in the queue, so it moves at once. Running or swapped: the new value
        counts from the next victim choice and the next admission decision on."""
        if not self.policy.uses_priority:
            raise ValueError(f"cannot set a priority: the scheduler policy is "
                             f"{self.config.policy!r}; priorities need --policy priority")
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, not {priority!r}")
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.priority = priority
        self.waiting.rekey(req)  # a no-op unless it waits
        return True


def _because(reason: str) -> str:
    return f" because {reason}" if reason else ""
