"""Engine configuration: what the scheduler and the KV cache are allowed to do.

Every field is validated when the dataclass is built, and an invalid value raises a
ValueError that names the field, the value and what is allowed, so a typo on the command
line fails at start-up rather than as a stuck request later.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from llmtower.core.swap_layout import PLAIN, SwapLayout

Policy = Literal["fcfs", "priority", "sjf", "fair"]
PreemptionMode = Literal["recompute", "swap"]
PreemptionVictim = Literal["priority", "remaining"]
KVAllocator = Literal["plain", "relocator"]


def _require(cond: bool, field: str, value: object, allowed: str) -> None:
    if not cond:
        raise ValueError(f"{field}={value!r} is invalid: {field} must be {allowed}")


@dataclass
class SchedulerConfig:
    """Owns the limits of one scheduling step and the policies that fill it.

    - ``max_num_seqs``: most requests running (holding KV blocks) at once.
    - ``max_num_batched_tokens``: token budget of one forward pass (prefill + decode).
    - ``max_model_len``: longest sequence (prompt + output) a request may reach.
    - ``policy``: order of the waiting queue: ``fcfs``, ``priority`` (lower value first) or
      ``sjf`` (shortest predicted work first, aged by ``sjf_aging_tokens_per_s``) or ``fair``
      (per-tenant Virtual Token Counter, tenants weighted by ``tenant_weights``).
    - ``preemption_victim``: among the lowest-ranked running requests, preempt the latest
      arrival (``priority``) or the one with the most predicted remaining work (``remaining``).
    - ``preemption_mode``: ``recompute`` (free blocks, redo the prefill later) or ``swap``
      (copy blocks to CPU swap space; falls back to recompute when it is full).
    - ``enable_chunked_prefill``: prompts may be split across steps; when off, a prompt is
      prefilled in one step, so ``max_num_batched_tokens`` must cover ``max_model_len``.
    - ``long_prefill_token_threshold``: most prompt tokens one request gets per step (0: no cap).
    - ``max_num_partial_prefills``: most requests per step whose prefill chunk does not
      complete their prompt.
    - ``max_num_queued_reqs`` / ``max_num_queued_tokens``: admission limits of the waiting
      queue (0: unlimited); beyond them ``add_request`` raises ``QueueFullError`` (HTTP 429).
    - ``enable_degradation``: under KV or host-memory pressure, step down (count cache
      evictions, shrink the batch, refuse new work with 429) and back up when it passes
      (``core/sched/degradation.py``).
    - ``max_bypass``: how many later requests may overtake a waiting request that does not fit
      before the scheduler stops admitting anyone behind it (no starvation, no head-of-line
      blocking).
    - ``max_loras``: most distinct LoRA adapters among running requests, hence in a step
      (0: LoRA off); a request whose adapter would exceed it waits like one that does not fit.
    """

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    policy: Policy = "fcfs"
    preemption_mode: PreemptionMode = "recompute"
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int = 1
    max_num_queued_reqs: int = 0
    max_num_queued_tokens: int = 0
    max_bypass: int = 8
    enable_degradation: bool = False
    sjf_aging_tokens_per_s: float = 100.0
    preemption_victim: PreemptionVictim = "priority"
    tenant_weights: dict[str, float] = field(default_factory=dict)
    # Why max_model_len is what it is, when the model forced it (named in admission errors).
    max_model_len_reason: str = ""
    max_loras: int = 0

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, "an integer >= 1")
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens",
                 self.max_num_batched_tokens, "an integer >= 1")
        _require(self.max_model_len >= 2, "max_model_len", self.max_model_len, "an integer >= 2")
        _require(self.policy in ("fcfs", "priority", "sjf", "fair"), "policy", self.policy,
                 "one of 'fcfs', 'priority', 'sjf', 'fair'")
        _require(self.preemption_victim in ("priority", "remaining"), "preemption_victim",
                 self.preemption_victim, "one of 'priority', 'remaining'")
        for tenant, w in self.tenant_weights.items():
            _require(isinstance(w, (int, float)) and w > 0, f"tenant_weights[{tenant!r}]", w,
                     "a number > 0")
        _require(self.preemption_mode in ("recompute", "swap"), "preemption_mode",
                 self.preemption_mode, "one of 'recompute', 'swap'")
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold",
                 self.long_prefill_token_threshold, "an integer >= 0 (0 disables the cap)")
        _require(self.max_num_partial_prefills >= 1, "max_num_partial_prefills",
                 self.max_num_partial_prefills, "an integer >= 1")
        _require(self.max_num_queued_reqs >= 0, "max_num_queued_reqs", self.max_num_queued_reqs,
                 "an integer >= 0 (0 means unlimited)")
        _require(self.max_num_queued_tokens >= 0, "max_num_queued_tokens",
                 self.max_num_queued_tokens, "an integer >= 0 (0 means unlimited)")
        _require(self.max_bypass >= 0, "max_bypass", self.max_bypass, "an integer >= 0")
        _require(self.max_loras >= 0, "max_loras", self.max_loras, "an integer >= 0 (0: off)")
        _require(self.sjf_aging_tokens_per_s >= 0, "sjf_aging_tokens_per_s",
                 self.sjf_aging_tokens_per_s, "a number >= 0")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} while chunked prefill is disabled, so a long "
                "prompt could never be scheduled: enable chunked prefill or raise "
                "max_num_batched_tokens to at least max_model_len")


@dataclass
class CacheConfig:
    """Owns the shape of the paged KV cache.

    - ``block_size``: token slots per KV block.
    - ``num_blocks``: device KV blocks (the executor may size it from a memory budget).
    - ``num_cpu_blocks``: CPU swap-space blocks used by ``preemption_mode='swap'``.
    - ``enable_prefix_caching``: reuse full blocks across requests through chained hashes.
    - ``kv_allocator``: ``plain`` (the pool alone) or ``relocator`` (the scheduler also moves
      blocks so that block tables and the free space become contiguous runs, once the layout
      fragmentation passes ``fragmentation_threshold``, at most ``max_block_moves_per_step``
      block copies per step).
    - ``max_pinned_blocks``: most cached blocks that preloaded prefixes may pin against
      eviction (0: a quarter of ``num_blocks``).
    - ``cache_dtype``: the KV storage dtype (``--kv-cache-dtype``; ``kernels/kv_quant.py``).
    - ``swap_space_dtype``: ``auto`` (swapped blocks as in the cache; compressed to int8 only at
      degradation level 2) or ``int8`` (every swap-out compressed); ``swap_layout``: the swap
      slots a block takes either way (``num_cpu_blocks`` counts slots; ``swap_layout.py``).
    - ``sliding_window``: the window (tokens) of a model whose every layer is windowed, else
      None: blocks wholly before a request's window are then returned to the pool as it
      proceeds (``KVCacheManager``; docs/sliding_window.md).
    """

    block_size: int = 16
    num_blocks: int = 1024
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    kv_allocator: KVAllocator = "plain"
    fragmentation_threshold: float = 0.5
    max_block_moves_per_step: int = 64
    max_pinned_blocks: int = 0
    cache_dtype: str = "auto"  # --kv-cache-dtype: auto (the model's), bfloat16 or int8
    swap_space_dtype: str = "auto"  # --swap-space-dtype: auto or int8
    swap_layout: SwapLayout = PLAIN
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", self.block_size, "an integer >= 1")
        _require(self.cache_dtype in ("auto", "bfloat16", "int8"), "kv_cache_dtype",
                 self.cache_dtype, "one of 'auto', 'bfloat16', 'int8'")
        _require(self.num_blocks >= 1, "num_blocks", self.num_blocks, "an integer >= 1")
        _require(self.num_cpu_blocks >= 0, "num_cpu_blocks", self.num_cpu_blocks,
                 "an integer >= 0")
        _require(self.swap_space_dtype in ("auto", "int8"), "swap_space_dtype",
                 self.swap_space_dtype, "one of 'auto', 'int8'")
        _require(self.kv_allocator in ("plain", "relocator"), "kv_allocator", self.kv_allocator,
                 "one of 'plain', 'relocator'")
        _require(0.0 <= self.fragmentation_threshold < 1.0, "fragmentation_threshold",
                 self.fragmentation_threshold, "a number in [0, 1) (0: defragment whenever "
                 "anything is out of place)")
        _require(self.max_block_moves_per_step >= 1, "max_block_moves_per_step",
                 self.max_block_moves_per_step, "an integer >= 1")
        _require(0 <= self.max_pinned_blocks <= self.num_blocks, "max_pinned_blocks",
                 self.max_pinned_blocks, f"an integer in 0..num_blocks={self.num_blocks} "
                 "(0: a quarter of the KV blocks)")
