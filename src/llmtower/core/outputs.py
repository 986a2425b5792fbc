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
from typing import TYPE_CHECKING

import msgspec

from llmtower.core.sampling_params import SamplingParams
from llmtower.lora.request import LoRARequest

if TYPE_CHECKING:
    import numpy as np


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
    lora_request: LoRARequest | None = None


@dataclass(slots=True)
class CachedRequestData:
    """What changed for a request the executor already holds.

    ``new_block_ids`` are appended to its block table, except when ``resumed_from_preemption``:
    then they replace it whole (its blocks were freed or swapped and it got new ones), and
    ``new_token_ids`` carries the tokens the executor has not seen (outputs it never sampled).
    Otherwise a non-empty ``new_token_ids`` holds tokens the scheduler appended after the
    executor's last sampled one (structured outputs' jump-forward): the executor appends them.
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
    # order: swap-out (device -> CPU), swap-in (CPU -> device).
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # The pairs are (block, swap slot): a block takes one slot, or, where swaps may be
    # compressed, several consecutive pairs (core/swap_layout.py). Device blocks whose
    # swap copy is int8 are listed here: quantized on the way out, dequantized on the way in.
    swap_out_compressed: list[int] = field(default_factory=list)
    swap_in_compressed: list[int] = field(default_factory=list)
    # The relocator's moves, performed after the swaps, as one gather-then-scatter batch: the
    # block in ``src`` now lives in ``dst``, so the executor also rewrites ``src`` to ``dst``
    # in the block tables it holds (before it adds this step's new requests, whose block ids
    # are already the new ones).
    blocks_to_move: list[tuple[int, int]] = field(default_factory=list)
    preempted_req_ids: set[str] = field(default_factory=set)
    finished_req_ids: set[str] = field(default_factory=set)
    # Structured outputs: one int32 bitmask row (1 bits = allowed tokens) per constrained
    # request that samples this step, and which row is whose. Applied to the logits before
    # sampling.
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: np.ndarray | None = None
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # Speculative decoding: the draft tokens scheduled after each request's last token
    # (counted in its num_scheduled_tokens, 1 + len(drafts)); absent: no drafts.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Requests left waiting after this step (speculative decoding's batch gate: where a
    # request that finishes early admits a waiting one, its drafts pay per request).
    num_waiting_reqs: int = 0
    # The scheduler's own request objects of this step, by id (the executor ignores it):
    # ``update_from_output`` drops outputs for ids this step did not schedule, and tells a
    # request from a new one that reused its id after an abort while the step was in flight.
    scheduled_requests: dict = field(default_factory=dict, repr=False, compare=False)
    # --async-scheduling: requests this step samples for, whose token the scheduler counted
    # as a placeholder when it scheduled the step (the executor ignores it).
    placeholder_req_ids: list[str] = field(default_factory=list, repr=False, compare=False)

    @classmethod
    def empty(cls) -> SchedulerOutput:
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
    # Speculative decoding: accepted drafts + one token in ``sampled_token_ids``; here the
    # next drafts proposed per request (None: speculation is off).
    spec_token_ids: list[list[int]] | None = None
    # Prompt logprobs scored this step, per request that asked (None: nobody did).
    prompt_logprobs: dict[str, list[LogprobsEntry]] | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """A tokenized request sent from a client (AsyncLLM, LLM) to the EngineCore."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0
    cache_salt: str | None = None
    tenant: str = ""  # who is served, for --policy fair (the OpenAI `user` / X-Tenant)
    lora_request: LoRARequest | None = None  # the adapter it runs with (None: the base model)


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
    # Speculative decoding: draft tokens verified for this request and how many were accepted.
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0


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
    # With the first token: the prompt's logprobs (entries of tokens 1..; prompt_logprobs).
    new_prompt_logprobs: list[tuple[int, float, int, list[tuple[int, float]]]] | None = None

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
    # --policy fair: per tenant, {tokens_served, num_admitted, queue_time_sum,
    # num_unfinished, counter, weight} (empty under the other policies).
    tenants: dict[str, dict[str, float]] = {}
    # Speculative decoding totals (vllm:spec_decode_*): verifications with drafts, draft
    # tokens, accepted drafts, and accepted drafts by position (index 0: first draft).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_num_accepted_tokens_per_pos: list[int] = []
    # Operator metrics (issue 13): schedule() alone per step since the previous snapshot,
    # messages received but not yet taken in by the busy loop, free-list fragmentation
    # (1 - largest free run / free blocks) and blocks registered in the prefix cache.
    step_schedule_seconds: list[float] = []
    input_queue_size: int = 0
    external_fragmentation: float = 0.0
    num_cached_blocks: int = 0
    # Memory under pressure (issue 14): the relocator's block moves so far, pinned prefix
    # blocks, the degradation level (0 normal .. 4 refusing) and its actions so far.
    num_block_moves_total: int = 0
    num_pinned_blocks: int = 0
    degradation_level: int = 0
    degradation_actions: dict[str, int] = {}
    # --enable-lora (vllm:lora_requests_info): the step limit and the adapters of running and
    # waiting requests, by name (max_lora 0: LoRA off).
    max_lora: int = 0
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """All outputs of one engine step (and, every so often, a stats snapshot)."""

    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    engine_index: int = 0
    # (request id, why) of requests that failed after admission (a grammar that did not
    # compile, or not in time): the client answers them as rejected (HTTP 400).
    request_errors: list[tuple[str, str]] = []
