"""The step-time model: a roofline per engine step.

For one forward pass over a batch (all numbers per tensor-parallel rank):

    compute = (tokens * linear FLOPs/token + sampled * LM-head FLOPs
               + attention pairs * attention FLOPs/pair) / effective FLOP/s
    memory  = (weights read once + (KV tokens read + KV tokens written) * KV bytes/token)
              / effective bandwidth
    step    = overhead + seqs * per-seq overhead + max(compute, memory)
              + all-reduce time (tensor parallelism) + swap time (preemption by swap)

(a device profile with ``overlap: sum`` adds compute and memory instead of taking the max: a
CPU engine mostly alternates between compute-bound GEMMs and memory-bound gathers).

"Attention pairs" is the number of (query token, key token) pairs: a decode token at context c
contributes c, a prefill chunk of n tokens after c computed ones contributes n*c + n(n+1)/2.
Compute and memory traffic overlap (the max), communication and swaps do not (the sum).
"""
from __future__ import annotations

from dataclasses import dataclass

from llmtower.sim.profiles import DeviceProfile, ModelProfile


@dataclass(frozen=True)
class StepCost:
    """The parts of one step's predicted time (seconds)."""

    compute_s: float
    memory_s: float
    comm_s: float
    swap_s: float
    overhead_s: float
    overlap: bool = True  # compute and memory traffic overlap (max) or not (sum)

    @property
    def total_s(self) -> float:
        body = (max(self.compute_s, self.memory_s) if self.overlap
                else self.compute_s + self.memory_s)
        return self.overhead_s + body + self.comm_s + self.swap_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


class CostModel:
    """Owns the roofline of one model on one device type at a tensor-parallel degree, reduced
    to a handful of seconds-per-unit constants so that a step costs a few multiplications."""

    def __init__(self, model: ModelProfile, device: DeviceProfile,
                 tensor_parallel_size: int = 1, block_size: int = 16) -> None:
        tp = tensor_parallel_size
        if tp < 1:
            raise ValueError(f"tensor_parallel_size={tp} is invalid: it must be >= 1")
        if model.num_heads % tp:
            raise ValueError(f"tensor_parallel_size={tp} does not divide {model.name}'s "
                             f"num_heads={model.num_heads}; choose a divisor of it")
        if tp > 1 and device.link_bandwidth <= 0:
            raise ValueError(f"device {device.name!r} has no link_bandwidth in its profile, so "
                             "tensor parallelism cannot be modelled; add it or use "
                             "--tensor-parallel-size 1")
        self.model = model
        self.device = device
        self.tp = tp
        self.block_size = block_size
        flops = device.effective_flops
        bw = device.effective_bandwidth
        # KV heads are split across ranks, replicated when there are fewer heads than ranks.
        kv_heads_per_rank = max(1, model.num_kv_heads // tp)
        self.kv_bytes_per_token_per_rank = (2 * model.num_layers * kv_heads_per_rank
                                            * model.head_size * model.kv_dtype_bytes)
        self.s_per_token = model.linear_flops_per_token / tp / flops
        self.s_per_sample = model.lm_head_flops_per_sample / tp / flops
        self.s_per_attn_pair = model.attn_flops_per_context_token / tp / flops
        self.s_weights = model.weight_bytes_read_per_step / tp / bw
        self.s_per_kv_token = self.kv_bytes_per_token_per_rank / bw
        self.overlap = device.overlap == "max"
        self.s_overhead = device.step_overhead_s
        self.s_per_seq = device.seq_overhead_s
        if tp > 1:
            # Two all-reduces per layer (after attention and after the MLP) of the hidden
            # states; a ring all-reduce moves 2 (tp-1)/tp of the buffer over each link.
            link = device.link_bandwidth * device.link_efficiency
            per_token = (2 * model.num_layers * 2 * (tp - 1) / tp
                         * model.hidden_size * model.dtype_bytes / link)
            self.s_comm_per_token = per_token
            self.s_comm_fixed = 2 * model.num_layers * device.link_latency_s
        else:
            self.s_comm_per_token = 0.0
            self.s_comm_fixed = 0.0
        self.s_per_swapped_block = (block_size * self.kv_bytes_per_token_per_rank
                                    / device.host_bandwidth)

    # ------------------------------------------------------------------ one step
    def step_time(self, num_tokens: int, num_sampled: int, attn_pairs: int, kv_tokens: int,
                  num_seqs: int = 0, num_swapped_blocks: int = 0) -> float:
        """Predicted seconds of one step; ``kv_tokens`` is the sum of the scheduled requests'
        context lengths (the KV read), ``num_sampled`` the requests whose logits are computed."""
        compute = (num_tokens * self.s_per_token + num_sampled * self.s_per_sample
                   + attn_pairs * self.s_per_attn_pair)
        memory = self.s_weights + (kv_tokens + num_tokens) * self.s_per_kv_token
        if self.overlap:
            body = compute if compute > memory else memory
        else:
            body = compute + memory
        t = self.s_overhead + num_seqs * self.s_per_seq + body
        if self.tp > 1 and num_tokens:
            t += self.s_comm_fixed + num_tokens * self.s_comm_per_token
        if num_swapped_blocks:
            t += num_swapped_blocks * self.s_per_swapped_block
        return t

    def cost(self, num_tokens: int, num_sampled: int, attn_pairs: int, kv_tokens: int,
             num_seqs: int = 0, num_swapped_blocks: int = 0) -> StepCost:
        """The same prediction as ``step_time``, split into its parts (for reports and tests)."""
        comm = (self.s_comm_fixed + num_tokens * self.s_comm_per_token
                if self.tp > 1 and num_tokens else 0.0)
        return StepCost(
            compute_s=(num_tokens * self.s_per_token + num_sampled * self.s_per_sample
                       + attn_pairs * self.s_per_attn_pair),
            memory_s=self.s_weights + (kv_tokens + num_tokens) * self.s_per_kv_token,
            comm_s=comm,
            swap_s=num_swapped_blocks * self.s_per_swapped_block,
            overhead_s=self.s_overhead + num_seqs * self.s_per_seq, overlap=self.overlap)

    # ------------------------------------------------------------------ memory
    def num_kv_blocks(self, gpu_memory_utilization: float = 0.9,
                      kv_cache_memory_per_rank: float | None = None) -> int:
        """KV blocks one replica holds: the memory left on each rank after its share of the
        weights (or an explicit per-rank KV budget, or the device's default one), divided by a
        block's bytes per rank."""
        if kv_cache_memory_per_rank is None and self.device.default_kv_cache_bytes:
            kv_cache_memory_per_rank = self.device.default_kv_cache_bytes
        if kv_cache_memory_per_rank is None:
            if not 0.0 < gpu_memory_utilization <= 1.0:
                raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization} must be "
                                 "in (0, 1]")
            usable = self.device.memory_bytes * gpu_memory_utilization
            weights = self.model.weight_bytes / self.tp
            kv_cache_memory_per_rank = usable - weights
            if kv_cache_memory_per_rank <= 0:
                need = 2
                while usable * need <= self.model.weight_bytes * 1.2:
                    need *= 2
                raise ValueError(
                    f"{self.model.name} needs {self.model.weight_bytes / 1e9:.1f} GB for its "
                    "weights "
                    f"but {self.tp} x {self.device.name} offer {usable * self.tp / 1e9:.1f} GB at "
                    f"gpu_memory_utilization={gpu_memory_utilization}; use "
                    f"--tensor-parallel-size {need} or a larger device")
        block_bytes = self.block_size * self.kv_bytes_per_token_per_rank
        blocks = int(kv_cache_memory_per_rank // block_bytes)
        if blocks < 1:
            raise ValueError(f"no room for a single KV block on {self.device.name}: give the KV "
                             "cache more memory or use more tensor-parallel ranks")
        return blocks

    def num_swap_blocks(self, swap_bytes_per_rank: float) -> int:
        return int(swap_bytes_per_rank // (self.block_size * self.kv_bytes_per_token_per_rank))
