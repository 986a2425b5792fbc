"""A request as the scheduler sees it: tokens, progress, status and lifecycle timestamps."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from llmtower.core.sampling_params import SamplingParams
from llmtower.lora.request import LoRARequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    SWAPPED = 2
    PREEMPTED = 3  # preempted by recompute: back in `waiting` with no KV blocks
    # Admitted, outside `waiting` until its grammar has compiled (structured outputs).
    WAITING_FOR_GRAMMAR = 4
    # Admitted, outside `waiting` until its LoRA adapter has been read (core/sched/adapter_wait.py).
    WAITING_FOR_ADAPTER = 5
    # Every status from here on is final.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_REJECTED = 13  # refused at admission

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_REJECTED: "rejected",
}


@dataclass
class RequestTimes:
    """Monotonic timestamps of a request's lifecycle (seconds; 0.0 = not yet)."""

    arrival: float = 0.0
    queued: float = 0.0
    first_scheduled: float = 0.0
    preempted: list[float] = field(default_factory=list)
    first_token: float = 0.0
    last_token: float = 0.0
    finished: float = 0.0

    @property
    def queue_time(self) -> float:
        return max(0.0, self.first_scheduled - self.queued) if self.first_scheduled else 0.0

    @property
    def ttft(self) -> float:
        return max(0.0, self.first_token - self.arrival) if self.first_token else 0.0

    @property
    def prefill_time(self) -> float:
        return max(0.0, self.first_token - self.first_scheduled) if self.first_token else 0.0

    @property
    def decode_time(self) -> float:
        return max(0.0, self.last_token - self.first_token) if self.first_token else 0.0


class Request:
    """Owns one request's token ids, its progress through the KV cache and its status.

    The one rule of the scheduler is that ``num_computed_tokens`` catches up with
    ``num_tokens``: a new prompt, a chunked prefill, a prefix-cache hit, a decode step and a
    recompute after preemption are all "compute the tokens from ``num_computed_tokens`` on".
    """

    __slots__ = (
        "request_id", "prompt_token_ids", "sampling_params", "eos_token_id", "priority",
        "arrival_time", "cache_salt", "status", "all_token_ids", "num_prompt_tokens",
        "num_computed_tokens", "num_cached_tokens", "num_preemptions", "max_tokens",
        "block_hashes", "times", "stop_reason", "num_bypassed", "sort_key",
        "seq", "queue_entry", "queued_tokens", "tenant",
        "spec_token_ids", "spec_num_draft_tokens", "spec_num_accepted_tokens",
        "structured_output", "prompt_logprobs", "num_output_placeholders", "lora_request",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_id: int | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
        tenant: str = "",
        lora_request: LoRARequest | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r} has an empty prompt: send at least one token")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_id = eos_token_id
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.cache_salt = cache_salt
        self.status = RequestStatus.WAITING
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit (tokens) at first admission; -1: not yet
        self.num_preemptions = 0
        # Resolved by the scheduler at admission (None in the params = up to max_model_len).
        self.max_tokens = sampling_params.max_tokens or 0
        self.block_hashes: list[bytes] = []  # chained hashes of full blocks, extended lazily
        self.times = RequestTimes(arrival=self.arrival_time)
        self.stop_reason: int | str | None = None
        self.num_bypassed = 0  # later requests admitted while this one did not fit
        self.sort_key: tuple = ()
        # Admission sequence number, set by the scheduler: the last tie-break of every
        # ordering, so that equal arrival times (n > 1 fan-out) still give a strict order.
        self.seq = 0
        # The waiting queue's live entry (0: not queued) and the tokens it counted for this
        # request: removal belongs to the entry, never to the id, which callers may reuse.
        self.queue_entry = 0
        self.queued_tokens = 0
        self.tenant = tenant  # who is served, for --policy fair ("" = the default tenant)
        # Speculative decoding: draft tokens to verify after the last token at the next step
        # (never part of all_token_ids), and this request's draft / accepted totals.
        self.spec_token_ids: list[int] = []
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        # The grammar state (structured_output.manager.GrammarState) of a constrained request.
        self.structured_output = None
        # Prompt logprobs scored so far, sent to the client with the first token.
        self.prompt_logprobs: list | None = None
        # --async-scheduling: tokens that steps in flight will sample for this request, not
        # in all_token_ids yet; the scheduler counts them as if they were (always 0 otherwise).
        self.num_output_placeholders = 0
        self.lora_request = lora_request  # the adapter it runs with (None: the base model)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """Known tokens plus those that steps in flight will sample (--async-scheduling)."""
        return len(self.all_token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, status={self.status.name}, "
                f"tokens={self.num_computed_tokens}/{self.num_tokens})")
