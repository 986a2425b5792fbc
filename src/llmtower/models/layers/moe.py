"""A sparse mixture-of-experts block: route each token to its top-k experts, group the step's
tokens by expert, and run one GEMM (gate/up, then down) per expert that has tokens.

Never a loop over tokens and never every expert for every token: a decode step of one token
with k active experts runs exactly k small MLPs; a prefill chunk of T tokens runs at most
``num_experts`` GEMMs whose rows add up to T * k. A step of at most ``KERNEL_MAX_TOKENS``
tokens whose experts are float SwiGLU MLPs with decode-kernel copies runs its chosen experts
in one C call instead (``kernels/moe_experts.py``), with the same results.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtower.kernels import ops
from llmtower.kernels.gemm_f32 import GemmF32Weight
from llmtower.kernels.gemv_bf16 import GemvWeight
from llmtower.kernels.moe_experts import MAX_ACTIVE, MAX_ROUTED_EXPERTS, MoEExperts
from llmtower.models.layers.mlp import GatedMLP
from llmtower.models.layers.weights import WeightTaker
from llmtower.models.linear import PackedWeight

# Steps of at most this many tokens run their experts in one kernel call (each token's experts
# streamed for it: past a few tokens, experts shared between tokens are better read once by the
# grouped path's GEMMs).
KERNEL_MAX_TOKENS = 4


@dataclass
class Routing:
    """How a router picks and weighs experts: ``top_k`` by softmax probability, renormalized
    over the chosen ones when ``normalize`` (Mixtral always; Qwen-MoE / OLMoE by
    ``norm_topk_prob``)."""

    top_k: int
    normalize: bool
    # gpt-oss: the top-k of the raw logits, softmaxed among themselves (normalize is moot).
    softmax_after_topk: bool = False


class SparseMoE:
    """Owns a layer's router matrix, its experts (``GatedMLP``s) and, for Qwen2-MoE, a shared
    expert added to every token, scaled by a sigmoid gate."""

    def __init__(self, router: torch.Tensor, experts: list[GatedMLP], routing: Routing,
                 shared: GatedMLP | None = None, shared_gate: torch.Tensor | None = None,
                 router_bias: torch.Tensor | None = None) -> None:
        if not 0 < routing.top_k <= len(experts):
            raise ValueError(f"num_experts_per_tok={routing.top_k} must be between 1 and the "
                             f"number of experts ({len(experts)})")
        self.router = router  # [E, hidden], in the model's dtype
        self.router_bias = router_bias  # [E] (gpt-oss)
        self.experts = experts
        self.routing = routing
        self.shared = shared
        self.shared_gate = shared_gate  # [1, hidden]
        # The one-call kernel, which also routes where the routing is the plain softmax one.
        self.kernel = experts_kernel(experts, router if router_bias is None
                                     and not routing.softmax_after_topk else None,
                                     routing.normalize) if routing.top_k <= MAX_ACTIVE else None

    @classmethod
    def load(cls, take: WeightTaker, prefix: str, hidden: int, intermediate: int,
             num_experts: int, routing: Routing, act: str, router_name: str = "gate",
             expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
             ) -> SparseMoE:
        """The block under ``prefix`` with HF's per-expert names
        (``<prefix>experts.<e>.<gate|up|down>.weight`` and ``<prefix><router_name>.weight``)."""
        router = take(prefix + router_name + ".weight", (num_experts, hidden))
        experts = [GatedMLP.load(take, f"{prefix}experts.{e}.", hidden, intermediate, act,
                                 expert_names) for e in range(num_experts)]
        return cls(router, experts, routing)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (expert ids [T, k] int64, weights [T, k] float32)."""
        logits = torch.nn.functional.linear(x, self.router, self.router_bias)
        if self.routing.softmax_after_topk:
            top, ids = torch.topk(logits, self.routing.top_k, dim=-1)
            return ids, torch.softmax(top, dim=-1)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.routing.top_k, dim=-1)
        if self.routing.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return ids, weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = self.routing.top_k
        if self.kernel is not None and x.shape[0] <= KERNEL_MAX_TOKENS:
            if self.kernel.router is not None:
                return self._add_shared(x, self.kernel.routed(x, k))
            ids, weights = self.route(x)
            return self._add_shared(x, self.kernel(x, ids, weights))
        ids, weights = self.route(x)
        if x.shape[0] == 1:
            # One token (a one-stream decode step): its k experts straight on x, in expert
            # order as below, without the sort, gather and scatter.
            out = torch.zeros_like(x)
            w = weights[0].to(x.dtype)  # rounded as the grouped path rounds them
            chosen = ids[0].tolist()
            for j in sorted(range(k), key=chosen.__getitem__):
                out += self.experts[chosen[j]](x).mul_(w[j])
            return self._add_shared(x, out)
        flat = ids.reshape(-1)
        # Group the (token, choice) pairs by expert: one stable sort, then each expert's run.
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()
        token_of = (order // k)
        weight_of = weights.reshape(-1)[order].to(x.dtype)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = token_of[start:start + n]
            y = self.experts[e](x.index_select(0, rows))
            out.index_add_(0, rows, y.mul_(weight_of[start:start + n, None]))
            start += n
        return self._add_shared(x, out)

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` plus the shared expert's output where there is one (Qwen2-MoE)."""
        if self.shared is not None:
            s = self.shared(x)
            if self.shared_gate is not None:
                s = s * torch.sigmoid(torch.nn.functional.linear(x, self.shared_gate))
            out += s
        return out


def experts_kernel(experts: list[GatedMLP], router: torch.Tensor | None = None,
                   normalize: bool = True) -> MoEExperts | None:
    """The one-call kernel over ``experts`` where it computes what they do: float SwiGLU MLPs
    without biases whose gate/up pair and down matrix have the decode kernels' copies
    (``PackedWeight``), and a CPU where the kernel for their dtype runs; else None. With
    ``router`` (softmax routing, ``normalize`` as ``Routing``) it routes too, where it can."""
    gate_up: list[GemvWeight | GemmF32Weight] = []
    down: list[GemvWeight | GemmF32Weight] = []
    for mlp in experts:
        if not isinstance(mlp, GatedMLP) or mlp.act != "silu" or mlp.gate_up is not None or mlp.down_bias is not None \
                or type(mlp.gate) is not PackedWeight or type(mlp.down) is not PackedWeight \
                or not mlp.gate.gemv.silu_pair:
            return None
        gate_up.append(mlp.gate.gemv)
        down.append(mlp.down.gemv)
    kernel = "moe_experts_f32" if isinstance(gate_up[0], GemmF32Weight) else "moe_experts_bf16"
    if not ops.capabilities().can_run(kernel):
        return None
    try:
        plain = MoEExperts(gate_up, down)
    except ValueError:  # mixed layouts: the experts run one by one
        return None
    if router is not None and router.dtype == plain.dtype \
            and router.shape == (plain.num_experts, plain.hidden) \
            and plain.num_experts <= MAX_ROUTED_EXPERTS:
        return MoEExperts(gate_up, down, router, normalize)
    return plain
