"""OLMo 2: norms after attention and after the MLP (not before), and q/k norms over the
whole q and k projections."""
from __future__ import annotations

from llmtower.models.decoder import DecoderLM


class Olmo2ForCausalLM(DecoderLM):
    """OLMo 2 (``Olmo2ForCausalLM``)."""

    family = "OLMo 2"
    qk_norm = "full"
    norm_names = {"post_attn": "post_attention_layernorm",
                  "post_mlp": "post_feedforward_layernorm"}
