"""Messages between the scheduler, the executor and the engine's clients.

``SchedulerOutput`` goes from the scheduler to the executor once per step. It follows vLLM
v1: a request's full data (prompt, sampling params, block ids) is sent once, in
``scheduled_new_reqs``; afterwards only deltas travel in ``scheduled_cached_reqs`` so the model
runner can keep its per-request state across steps. ``ModelRunnerOutput`` comes back. The
engine turns both into ``EngineCoreOutputs`` for its clients. ``EngineCoreRequest`` and
``EngineCoreOutputs`` cross process boundaries, so they are msgspec structs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from llmtower.core.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the executor has not seen yet (sent once)."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    # The request's EOS, which the sampler masks until min_tokens outputs exist.
    eos_token_id: int | None = None


@dataclass(slots=True)
class CachedRequestData:
    """What changed for a request the executor already holds.

    ``new_block_ids`` are appended to its block table, except when ``resumed_from_preemption``:
    then they replace it whole (its blocks were freed or swapped and it got new ones), and
    ``new_token_ids`` carries the tokens the executor has not seen (outputs it never sampled).
    """

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int
    resumed_from_preemption: bool = False
    new_token_ids: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """The decision of one step: who runs, with how many tokens, on which blocks."""

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # (src, dst) block-id pairs the executor performs *before* the forward pass, in this
    # order: swap-out (device -> CPU), swap-in (CPU -> device), device-to-device copies.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0

    @classmethod
    def empty(cls) -> "SchedulerOutput":
        return cls([], [], {}, 0)


@dataclass
class LogprobsEntry:
    """Log-probability of one sampled token and its top alternatives."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class ModelRunnerOutput:
    """What the executor sampled: one list of tokens per scheduled request, in ``req_ids``
    order; the list is empty for a prefill chunk that did not reach the end of the prompt."""

    req_ids: list[str]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[LogprobsEntry]] | None = None

    @property
    def req_id_to_index(self) -> dict[str, int]:
        return {rid: i for i, rid in enumerate(self.req_ids)}


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized request sent from a client (AsyncLLM, LLM) to the EngineCore."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None


class RequestMetrics(msgspec.Struct, omit_defaults=True):
    """Per-request timings reported with the final output (seconds)."""

    arrival_time: float = 0.0
    queue_time: float = 0.0
    ttft: float = 0.0
    prefill_time: float = 0.0
    decode_time: float = 0.0
    e2e_latency: float = 0.0
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """New tokens of one request in one step; ``finish_reason`` set on its last output."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # What the client needs to report a request that a stop string ends on its side (the
    # engine then only hears of it as an abort): the queue time with the first token, the
    # preemption count so far with every output.
    queue_time: float = 0.0
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, omit_defaults=False):
    """A snapshot of the scheduler and KV cache, for metrics and operator tools."""

    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_swapped_reqs: int = 0
    kv_cache_usage: float = 0.0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_free_cpu_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_evictions: int = 0
    fragmentation: float = 0.0
    num_preemptions_total: int = 0
    num_swap_outs_total: int = 0
    num_swap_ins_total: int = 0
    num_rejected_total: int = 0
    num_steps: int = 0
    last_step_num_tokens: int = 0
    last_step_num_prefill_tokens: int = 0
    last_step_num_decode_tokens: int = 0
    token_budget: int = 0
    # Filled by EngineCoreProc: tokens and seconds of every step since the previous snapshot,
    # for the per-iteration histograms (a snapshot is sent only every ~0.5 s).
    step_num_tokens: list[int] = []
    step_seconds: list[float] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step (and, every so often, a stats snapshot)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0
