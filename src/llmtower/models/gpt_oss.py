"""gpt-oss: attention with biases and per-head sink logits, alternating local (128-token) and
global layers, YaRN RoPE, and a mixture of experts whose router has a bias and softmaxes its
top-k logits, whose experts have biases and a clamped SwiGLU (``(up + 1) * gate *
sigmoid(1.702 * gate)``), stored as 3-D tensors with gate and up interleaved. Weights in
bfloat16 or float32 (an MXFP4 checkpoint must be dequantized first: refused by name)."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM, Mlp
from llmtower.models.layers.attention import AttentionOptions
from llmtower.models.layers.mlp import OSS_ALPHA, OSS_LIMIT, GatedMLP
from llmtower.models.layers.moe import Routing, SparseMoE
from llmtower.models.layers.weights import WeightTaker


class GptOssForCausalLM(DecoderLM):
    """gpt-oss (``GptOssForCausalLM``)."""

    family = "gpt-oss"

    def attention_options(self, i: int) -> AttentionOptions:
        opt = super().attention_options(i)
        opt.sinks = True
        return opt

    def load_mlp(self, take: WeightTaker, prefix: str, i: int) -> Mlp:  # noqa: ARG002
        c = self.config
        if c.get("quantization_config"):
            raise ValueError("this gpt-oss checkpoint is quantized (MXFP4): llmtower reads its "
                             "bfloat16 / float32 weights; dequantize it first (transformers' "
                             "Mxfp4Config(dequantize=True), then save_pretrained)")
        h, inter = c.hidden_size, c.intermediate_size
        e = int(c.get("num_local_experts", 0))
        p = prefix + "mlp."
        gate_up = take(p + "experts.gate_up_proj", (e, h, 2 * inter))
        gate_up_bias = take(p + "experts.gate_up_proj_bias", (e, 2 * inter))
        down = take(p + "experts.down_proj", (e, inter, h))
        down_bias = take(p + "experts.down_proj_bias", (e, h))
        alpha = float(c.get("swiglu_alpha", OSS_ALPHA))
        limit = float(c.get("swiglu_limit", OSS_LIMIT))
        # Columns alternate gate, up: de-interleave into [I, H] matrices (rows = outputs).
        experts = [GatedMLP(gate_up[j][:, 0::2].t().contiguous(),
                            gate_up[j][:, 1::2].t().contiguous(),
                            down[j].t().contiguous(), "swiglu_oss",
                            gate_up_bias=gate_up_bias[j].view(inter, 2).t().reshape(-1).contiguous(),
                            down_bias=down_bias[j].contiguous(), alpha=alpha, limit=limit)
                   for j in range(e)]
        return SparseMoE(take(p + "router.weight", (e, h)), experts,
                         Routing(int(c.get("num_experts_per_tok", 4)), False,
                                 softmax_after_topk=True),
                         router_bias=take(p + "router.bias", (e,)))
