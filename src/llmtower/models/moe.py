"""Mixture-of-experts families: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE. Their attention is
their dense sibling's (Mistral, Qwen2, Qwen3, OLMo 2's q/k norms); their MLP a
``SparseMoE`` (layers/moe.py): softmax router, top-k experts, one GEMM per active expert."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM, Mlp
from llmtower.models.layers.attention import AttentionOptions
from llmtower.models.layers.mlp import GatedMLP
from llmtower.models.layers.moe import Routing, SparseMoE
from llmtower.models.layers.weights import WeightTaker


class MixtralForCausalLM(DecoderLM):
    """Mixtral (``MixtralForCausalLM``): ``block_sparse_moe`` with experts w1 (gate), w3 (up),
    w2 (down); the chosen experts' weights always renormalized."""

    family = "Mixtral"

    def load_mlp(self, take: WeightTaker, prefix: str, i: int) -> Mlp:  # noqa: ARG002
        c = self.config
        return SparseMoE.load(take, prefix + "block_sparse_moe.", c.hidden_size,
                              c.intermediate_size, int(c.get("num_local_experts", 8)),
                              Routing(int(c.get("num_experts_per_tok", 2)), True),
                              c.hidden_act, expert_names=("w1", "w3", "w2"))


class Qwen3MoeForCausalLM(DecoderLM):
    """Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's per-head q/k norms; layers listed in
    ``mlp_only_layers`` or off the ``decoder_sparse_step`` keep a dense MLP."""

    family = "Qwen3-MoE"
    qk_norm = "head"

    def _sparse(self, i: int) -> bool:
        c = self.config
        step = int(c.get("decoder_sparse_step", 1))
        return (i not in (c.get("mlp_only_layers") or []) and self._num_experts() > 0
                and step > 0 and (i + 1) % step == 0)

    def _num_experts(self) -> int:
        # transformers v5 writes Qwen3-MoE's as num_local_experts.
        c = self.config
        return int(c.get("num_experts", c.get("num_local_experts", 0)))

    def load_mlp(self, take: WeightTaker, prefix: str, i: int) -> Mlp:
        c = self.config
        if not self._sparse(i):
            return super().load_mlp(take, prefix, i)
        inter = int(c.get("moe_intermediate_size", c.intermediate_size))
        return SparseMoE.load(take, prefix + "mlp.", c.hidden_size, inter, self._num_experts(),
                              Routing(int(c.get("num_experts_per_tok", 1)),
                                      bool(c.get("norm_topk_prob", False))), c.hidden_act)


class Qwen2MoeForCausalLM(Qwen3MoeForCausalLM):
    """Qwen2-MoE (``Qwen2MoeForCausalLM``): q/k/v biases, no q/k norms, and a shared expert
    beside the routed ones, scaled per token by a sigmoid gate."""

    family = "Qwen2-MoE"
    qk_norm = ""

    def load_mlp(self, take: WeightTaker, prefix: str, i: int) -> Mlp:
        moe = super().load_mlp(take, prefix, i)
        c = self.config
        size = int(c.get("shared_expert_intermediate_size", 0))
        if isinstance(moe, SparseMoE) and size:
            moe.shared = GatedMLP.load(take, prefix + "mlp.shared_expert.", c.hidden_size, size,
                                       c.hidden_act)
            moe.shared_gate = take(prefix + "mlp.shared_expert_gate.weight", (1, c.hidden_size))
        return moe


class OlmoeForCausalLM(Qwen3MoeForCausalLM):
    """OLMoE (``OlmoeForCausalLM``): OLMo's q/k norms over whole projections, optional
    ``clip_qkv``, every layer sparse."""

    family = "OLMoE"
    qk_norm = "full"

    def attention_options(self, i: int) -> AttentionOptions:
        opt = super().attention_options(i)
        clip = self.config.get("clip_qkv")
        opt.clip_qkv = float(clip) if clip is not None else None
        return opt
